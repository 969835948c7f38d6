"""OpenAI's four prompt forms: a text, texts, token ids, or arrays of token ids (completions' `prompt`,
embeddings' `input`).

Either way the value is a list of prompts, each a text or token ids, and each
is served by a request of its own. The form is told from the value's shape (a
callable discriminator) rather than tried four ways, so that a wrong value's
error is that form's, and where in it (`prompt.1.3`: the second prompt's
fourth id; schemas/placement.py leaves the form's tag out of the name),
instead of four alternatives' at once.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag

from schemas.parameters import INT32_MAX

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Prompt = str | list[int]


def _form(value: Any) -> str:
    if isinstance(value, list) and value and isinstance(value[0], str):
        return "texts"
    if isinstance(value, list) and value and isinstance(value[0], list):
        return "token arrays"
    return "text" if isinstance(value, str) else "token ids"


PromptForms = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts")]
    | Annotated[list[TokenId], Tag("token ids")]
    | Annotated[list[list[TokenId]], Tag("token arrays")],
    Discriminator(_form),
]


def each_prompt(value: str | list) -> list[Prompt]:
    """The prompts a value of one of the forms holds, in order."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return list(value)


def check_prompts(value: str | list, most: int) -> str | list:
    """A value with at least one prompt, at most `most`, none of them empty (no text, or no token ids)."""
    prompts = each_prompt(value)
    if not prompts:
        raise ValueError("it is empty")
    if len(prompts) > most:
        raise ValueError(f"at most {most} per request are served; received {len(prompts)}")
    empty = next((index for index, prompt in enumerate(prompts) if not prompt), None)
    if empty is not None:
        raise ValueError("it is empty" if isinstance(value, str) else f"item {empty} is empty")
    return value
