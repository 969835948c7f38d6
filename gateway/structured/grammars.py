"""Structured output requests as llguidance grammars, checked before any worker sees them.

A JSON schema (OpenAI's response_format, TGI's `grammar` of type json), any
JSON object (json_object), or a regex (TGI's type regex) becomes an
llguidance grammar. A schema is read strictly, as xgrammar reads it: no key
or item it does not name (strict_schemas.py). JSON is compact (no free
whitespace between tokens), so that a sampled answer cannot wander off
into blank lines. llguidance checks a grammar without a tokenizer; what it
cannot serve (a schema keyword it does not implement, a broken regex) is
refused here, naming the field and the reason, rather than served
unconstrained.
"""

from __future__ import annotations

import json

from llguidance import LLMatcher

from gateway.errors import unprocessable
from gateway.structured.strict_schemas import strict_schema
from schemas.parameters import Grammar

_JSON_OPTIONS = {"whitespace_flexible": False}


def json_schema_grammar(schema: dict | str, field: str) -> str:
    """The grammar of JSON texts that validate against `schema` read strictly; 422 naming `field` if it cannot be
    served."""
    try:
        parsed = json.loads(schema) if isinstance(schema, str) else schema
        grammar = LLMatcher.grammar_from_json_schema(strict_schema(parsed), overrides=_JSON_OPTIONS)
    except (ValueError, TypeError) as error:
        raise unprocessable(f"{field}: not a JSON schema: {error}") from None
    except RecursionError:
        raise unprocessable(f"{field}: this server cannot constrain output to it: it is nested too deeply") from None
    return _checked(grammar, field)


def json_object_grammar(field: str) -> str:
    return json_schema_grammar({"type": "object"}, field)


def regex_grammar(regex: str, field: str) -> str:
    return _checked(LLMatcher.grammar_from_regex(regex), field)


def _checked(grammar: str, field: str) -> str:
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise unprocessable(f"{field}: this server cannot constrain output to it: {error.strip()}")
    return grammar


def grammar_parameter(grammar: Grammar | None, field: str = "parameters.grammar") -> str | None:
    """The `grammar` parameter (TGI's shape, on the TGI and MindIE routes) as a grammar."""
    if grammar is None:
        return None
    if grammar.type == "regex":
        if not isinstance(grammar.value, str):
            raise unprocessable(f"{field}.value: a regex is a string")
        return regex_grammar(grammar.value, f"{field}.value")
    return json_schema_grammar(grammar.value, f"{field}.value")
