"""Schemas are read strictly (gateway/structured/strict_schemas.py): checked with the grammar the gateway sends workers.

Each text is fed, as the bundled tokenizer's tokens, to an llguidance matcher
of the grammar `json_schema_grammar` makes (what every route's schema goes
through: response_format, forced tool calls, Responses' text.format, TGI's
and MindIE's `grammar`): a text is allowed when the matcher takes all of it
and may stop there.
"""

from __future__ import annotations

import copy
import json

import pytest
from llguidance import LLMatcher, LLTokenizer

from gateway.errors import ApiError
from gateway.structured.grammars import grammar_parameter, json_schema_grammar
from schemas.parameters import Grammar
from workers.bundled import BUNDLED_MODEL

INTEGER = {"type": "integer"}
CITY = {"type": "object", "properties": {"name": {"type": "string"}, "population": INTEGER}, "required": ["name"]}


@pytest.fixture(scope="module")
def tokenizer() -> LLTokenizer:
    return LLTokenizer(str(BUNDLED_MODEL / "tokenizer.json"))


def allows(tokenizer: LLTokenizer, grammar: str, text: str) -> bool:
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    tokens = tokenizer.tokenize_str(text)
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) and matcher.is_accepting()


def allowed(tokenizer: LLTokenizer, schema, texts: list[str]) -> list[bool]:
    grammar = json_schema_grammar(schema, "schema")
    return [allows(tokenizer, grammar, text) for text in texts]


def test_an_object_takes_only_the_keys_its_schema_names_unless_it_says_otherwise(tokenizer):
    texts = ['{"name":"Oslo","population":1}', '{"name":"Oslo"}', '{"name":"Oslo","mayor":"x"}']
    assert allowed(tokenizer, CITY, texts) == [True, True, False]
    assert allowed(tokenizer, {**CITY, "additionalProperties": True}, texts) == [True, True, True]
    typed_extras = {**CITY, "additionalProperties": INTEGER}
    assert allowed(tokenizer, typed_extras, ['{"name":"Oslo","mayor":"x"}', '{"name":"Oslo","area":454}']) == [
        False,
        True,
    ]
    patterned = {"type": "object", "patternProperties": {"^x_": INTEGER}}
    assert allowed(tokenizer, patterned, ['{"x_a":1}', '{"y":1}']) == [True, False]


def test_nested_objects_are_as_strict_wherever_they_stand(tokenizer):
    """Under a property, in an array's items, behind a $ref (pydantic's $defs) and in an Optional's anyOf."""
    city_ref = {"$ref": "#/$defs/City"}
    schema = {
        "type": "object",
        "properties": {
            "home": city_ref,
            "visited": {"type": "array", "items": city_ref},
            "next": {"anyOf": [city_ref, {"type": "null"}]},
            "inline": {"type": "object", "properties": {"a": INTEGER}},
        },
        "$defs": {"City": CITY},
    }
    assert allowed(
        tokenizer,
        schema,
        [
            '{"home":{"name":"a"},"visited":[{"name":"b"}],"next":null,"inline":{"a":1}}',
            '{"home":{"name":"a","x":1}}',
            '{"visited":[{"name":"b","x":1}]}',
            '{"next":{"name":"a","x":1}}',
            '{"inline":{"a":1,"x":1}}',
            '{"home":{"name":"a"},"x":1}',
        ],
    ) == [True, False, False, False, False, False]


def test_a_key_required_without_a_schema_keeps_any_value_and_no_other_key_comes(tokenizer):
    schema = {"type": "object", "properties": {"a": INTEGER}, "required": ["a", "b"]}
    assert allowed(tokenizer, schema, ['{"a":1,"b":[true]}', '{"a":1,"b":2,"c":3}']) == [True, False]


def test_a_tuple_takes_no_item_past_its_prefix_unless_items_says_so(tokenizer):
    pair = {"type": "array", "prefixItems": [INTEGER, {"type": "string"}]}
    assert allowed(tokenizer, pair, ['[1,"a"]', '[1,"a",2]']) == [True, False]
    assert allowed(tokenizer, {**pair, "items": INTEGER}, ['[1,"a",2]']) == [True]


def test_what_names_nothing_stays_open_as_in_xgrammar(tokenizer):
    """A bare object (json_object's schema), a bare array, an empty schema, and a property of any value."""
    anything = ['{"b":{"c":[1,"x"]}}', "[1,{},null]"]
    assert allowed(tokenizer, {"type": "object"}, anything) == [True, False]
    assert allowed(tokenizer, {"type": "array", "description": "any"}, anything) == [False, True]
    assert allowed(tokenizer, {}, anything) == [True, True]
    assert allowed(tokenizer, {"type": "object", "properties": {"v": {}}}, ['{"v":{"b":{"c":1}}}']) == [True]


def test_schemas_llguidance_merges_stay_open_to_each_others_keys(tokenizer):
    """Closing each part of a merge would refuse the keys the other part brings."""
    a, b = {"type": "object", "properties": {"a": INTEGER}}, {"type": "object", "properties": {"b": INTEGER}}
    both = '{"a":1,"b":2}'
    assert allowed(tokenizer, {"allOf": [a, b]}, [both]) == [True]
    referred = {"allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}], "$defs": {"A": a, "B": b}}
    assert allowed(tokenizer, referred, [both]) == [True]
    assert allowed(tokenizer, {**a, "anyOf": [b]}, [both]) == [True]


def test_the_callers_schema_is_left_as_it_was_and_json_text_is_read_the_same_way(tokenizer):
    schema = copy.deepcopy(CITY)
    json_schema_grammar(schema, "schema")
    assert schema == CITY
    tgi = grammar_parameter(Grammar(type="json", value=json.dumps(CITY)))
    assert tgi == json_schema_grammar(CITY, "schema")
    assert not allows(tokenizer, tgi, '{"name":"Oslo","mayor":"x"}')


def test_a_schema_that_cannot_be_read_is_a_422_naming_the_field():
    """Broken JSON text, and nesting past what can be walked: a JSON text (TGI's value may be one) any deep, or
    an object as deep as a body may carry (1000 levels)."""
    deep_text = '{"type":"object","properties":{"a":' * 5000 + "{}" + "}}" * 5000
    deep: dict = INTEGER
    for _ in range(490):
        deep = {"type": "object", "properties": {"a": deep}}
    for schema, field in (
        ("{not json", "parameters.grammar.value"),
        (deep_text, "parameters.grammar.value"),
        (deep, "response_format.json_schema.schema"),
    ):
        with pytest.raises(ApiError) as refused:
            json_schema_grammar(schema, field)
        assert refused.value.status == 422 and refused.value.body.error.startswith(f"{field}: "), schema
