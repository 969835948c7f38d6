"""The sampling parameters of MindIE's routes: one definition per parameter, one subset per route.

Each route reads the parameters its source document lists, or a sibling
route's document lists (../shared/spec/API.md), so each has a class that
names them; the ranges are the contract's. Any other field is ignored and
named (schemas/body.py). Three extensions on every route: `ignore_eos`
(generate max_new_tokens whatever the model says, as AISBench asks in its
benchmarks), `grammar` (structured output, in TGI's shape), which no MindIE
document has a place for, and `speculative` (false: a speculating worker
proposes no tokens for the request). `null` means "not given".
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from schemas.body import Body
from schemas.messages import SamplingParams

INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
DEFAULT_MAX_NEW_TOKENS = 20

# strict: 5.0 is not an int and "5" is not a number; ints are still accepted as floats.
STRICT = ConfigDict(strict=True)

Details = Annotated[bool | None, Field(description="Return generation details.")]
DoSample = Annotated[
    bool | None, Field(description="Sample rather than take the likeliest token; absent: sample iff a parameter asks.")
]
MaxNewTokens = Annotated[
    int | None, Field(gt=0, le=INT32_MAX, description="At most this many new tokens, also capped by maxIterTimes; 20.")
]
RepetitionPenalty = Annotated[float | None, Field(gt=0.0, description="1.0 (default) = off.")]
Seed = Annotated[int | None, Field(gt=0, le=UINT64_MAX, description="Absent: the server draws one.")]
Temperature = Annotated[float | None, Field(gt=1e-6, description="Default 1.0.")]
TopK = Annotated[int | None, Field(gt=0, le=INT32_MAX, description="Values over the vocabulary size mean all of it.")]
TopKOrOff = Annotated[int | None, Field(ge=0, le=INT32_MAX, description="0 (default) = off.")]
TopP = Annotated[float | None, Field(gt=1e-6, le=1.0, description="Default 1.0.")]
TopPBelowOne = Annotated[float | None, Field(gt=1e-6, lt=1.0, description="Absent: off; 1.0 may not be set.")]
TypicalP = Annotated[float | None, Field(gt=0.0, le=1.0, description="Absent: off.")]
Watermark = Annotated[bool | None, Field(description="Accepted; watermarking is not implemented.")]
IgnoreEos = Annotated[
    bool | None,
    Field(description="Generate max_new_tokens whatever the model says: finish reason length; default false."),
]
BatchSize = Annotated[int | None, Field(gt=0, le=INT32_MAX, description="Informational.")]
PerfStat = Annotated[bool | None, Field(description="Accepted for compatibility.")]
Priority = Annotated[int | None, Field(ge=1, le=5, description="1 is the most urgent; default 5.")]
Timeout = Annotated[int | None, Field(gt=0, le=3600, description="Seconds from arrival to the last token; 600.")]
FirstTokenCost = Annotated[
    int | None, Field(ge=0, le=UINT64_MAX, description="Recomputation: milliseconds the first token took.")
]
DecodeTime = Annotated[
    list[Annotated[int, Field(ge=0, le=UINT64_MAX)]] | None,
    Field(description="Recomputation: milliseconds each later token took before the break."),
]


class Grammar(Body):
    """Structured output, in TGI's shape: the text matches a JSON schema (an object, or JSON text) or a regex."""

    model_config = STRICT

    type: Literal["json", "regex"]
    value: dict | str = Field(description="The JSON schema, or the regex.")


GrammarParameter = Annotated[
    Grammar | None, Field(description="The text matches this JSON schema or regex (TGI's `grammar`; an extension).")
]
SpeculativeParameter = Annotated[
    bool | None,
    Field(description="false: no tokens proposed for it on a speculating worker (same output; an extension)."),
]


class RouteParameters(Body):
    """What every route's parameters resolve to; a route lacks some fields, which then count as absent."""

    model_config = STRICT

    def given(self, name: str):
        """The parameter's value; None when it was not given, or when this route has no such parameter."""
        return getattr(self, name, None)

    def wants_sampling(self) -> bool:
        if self.given("do_sample") is not None:
            return self.given("do_sample")
        temperature, top_k, top_p = self.given("temperature"), self.given("top_k"), self.given("top_p")
        return (
            (temperature is not None and temperature != 1.0)
            or (top_k is not None and top_k > 0)
            or (top_p is not None and top_p < 1.0)
            or self.given("typical_p") is not None
        )

    def sampling(self, seed: int) -> SamplingParams:
        """The parameters a worker applies, defaults filled in; `seed` is used when none was given."""

        def or_default(name: str, default):
            value = self.given(name)
            return default if value is None else value

        return SamplingParams(
            do_sample=self.wants_sampling(),
            temperature=or_default("temperature", 1.0),
            top_k=or_default("top_k", 0),
            top_p=or_default("top_p", 1.0),
            typical_p=self.given("typical_p"),
            repetition_penalty=or_default("repetition_penalty", 1.0),
            seed=or_default("seed", seed),
            max_new_tokens=or_default("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
            stop=or_default("stop", []),
            speculative=or_default("speculative", True),
            ignore_eos=or_default("ignore_eos", False),
        )

    @property
    def wants_details(self) -> bool:
        return bool(self.given("details"))


class _Everywhere(RouteParameters):
    """What every route accepts."""

    details: Details = None
    do_sample: DoSample = None
    ignore_eos: IgnoreEos = None
    max_new_tokens: MaxNewTokens = None
    repetition_penalty: RepetitionPenalty = None
    seed: Seed = None
    temperature: Temperature = None
    watermark: Watermark = None


class _TypicalP(RouteParameters):
    typical_p: TypicalP = None


class _BatchSize(RouteParameters):
    batch_size: BatchSize = None


class _Queueing(RouteParameters):
    priority: Priority = None
    timeout: Timeout = None


class _Structured(RouteParameters):
    grammar: GrammarParameter = None
    speculative: SpeculativeParameter = None


class GenerateParameters(_Everywhere, _TypicalP, _BatchSize, _Queueing, _Structured):
    """/v2/models/{model}/generate (triton_generate.zh.txt; priority and timeout as its sibling routes have them)."""

    top_k: TopKOrOff = None
    top_p: TopP = None
    perf_stat: PerfStat = None


class GenerateStreamParameters(_Everywhere, _TypicalP, _BatchSize, _Queueing, _Structured):
    """/v2/models/{model}/generate_stream (triton_generate_stream.en.txt; perf_stat as generate has it)."""

    top_k: TopK = None
    top_p: TopP = None
    perf_stat: PerfStat = None
    firstTokenCost: FirstTokenCost = None
    decodeTime: DecodeTime = None

    @property
    def tokens_before(self) -> int:
        """Tokens a recomputed request had generated before the break (0 for a fresh one)."""
        return (self.firstTokenCost is not None) + len(self.decodeTime or ())


class InferTokenParameters(_Everywhere, _TypicalP, _Queueing, _Structured):
    """/infer_token and /infer (infer_token.en.txt)."""

    top_k: TopK = None
    top_p: TopPBelowOne = None


class TritonInferParameters(_Everywhere, _BatchSize, _Queueing, _Structured):
    """/v2/models/{model}/infer (triton_infer_token.zh.md)."""

    top_k: TopK = None
    top_p: TopP = None
