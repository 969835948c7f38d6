"""JSON schemas read strictly, as xgrammar (vLLM's, SGLang's and TensorRT-LLM's default backend) reads them.

By JSON Schema's letter, an object may carry keys its schema does not name
unless the schema says `additionalProperties: false`. Clients that write
schemas from their types (pydantic, and so instructor and the OpenAI SDK's
`parse`) seldom say it, and a small model that may write any key goes on
writing keys until `max_tokens`. So, as xgrammar's strict mode (its
default) does, what a schema names is all it allows:

- an object schema that lists `properties` (or `patternProperties`) and
  says nothing of `additionalProperties` takes no other key (a key that
  `required` names without a schema keeps any value);
- an array schema with `prefixItems` (or a list in `items`) and nothing
  said of what follows takes no item past them.

`additionalProperties: true`, or a schema for it, keeps the extra keys (and
`items` the extra items). What names nothing stays open, as in xgrammar:
`{"type": "object"}` is any object (json_object is that schema), `{"type":
"array"}` any array, `{}` any value. Schemas llguidance merges stay open
too, since closing one would refuse the keys the other brings: the parts of
an `allOf`, an `anyOf`/`oneOf` alternative beside `properties`, a schema
with `properties` beside those or a `$ref`, and the definitions such merges
refer to. llguidance has no option for any of this (its options are about
whitespace, separators and leniency), so the schema is rewritten, leaving
the caller's as it was.
"""

from __future__ import annotations

from typing import Any

_ONE = ("additionalProperties", "additionalItems", "items")  # keywords whose value is one subschema
_EACH = ("prefixItems", "items")  # whose value is a list of subschemas (`items` in the older drafts' tuples)
_BY_NAME = ("properties", "patternProperties", "$defs", "definitions")  # whose value maps names to subschemas
_ALTERNATIVES = ("anyOf", "oneOf")
_KEYED = ("properties", "patternProperties")
_MERGING = ("allOf", "anyOf", "oneOf", "$ref")


def strict_schema(schema: Any) -> Any:
    """`schema` with every open object and tuple that names its keys or items closed (see the module's doc)."""
    return _Closer(_merged_refs(schema)).close(schema, closes=True)


class _Closer:
    def __init__(self, merged_refs: set[str]) -> None:
        self._merged_refs = merged_refs  # "#/$defs/Name" of definitions that a merge takes in

    def close(self, schema: Any, closes: bool) -> Any:
        """The schema and its subschemas closed; `closes`: False where llguidance merges it with another."""
        if not isinstance(schema, dict):
            return schema
        keyed = any(key in schema for key in _KEYED)
        merges = keyed and any(key in schema for key in _MERGING)
        many = isinstance(schema.get("allOf"), list) and (len(schema["allOf"]) > 1 or keyed)
        closed = {}
        for key, value in schema.items():
            if key in _ONE and isinstance(value, dict):
                closed[key] = self.close(value, closes=True)
            elif key in _EACH and isinstance(value, list):
                closed[key] = [self.close(item, closes=True) for item in value]
            elif key in _BY_NAME and isinstance(value, dict):
                closed[key] = {name: self.close(sub, self._definition_closes(key, name)) for name, sub in value.items()}
            elif key == "allOf" and isinstance(value, list):
                closed[key] = [self.close(part, closes=not many) for part in value]
            elif key in _ALTERNATIVES and isinstance(value, list):
                closed[key] = [self.close(option, closes=not keyed) for option in value]
            else:
                closed[key] = value
        if closes and not merges:
            _close_object(closed)
            _close_tuple(closed)
        return closed

    def _definition_closes(self, keyword: str, name: str) -> bool:
        return keyword not in ("$defs", "definitions") or f"#/{keyword}/{name}" not in self._merged_refs


def _close_object(schema: dict) -> None:
    if "additionalProperties" in schema or not any(key in schema for key in _KEYED):
        return
    properties, required = schema.get("properties", {}), schema.get("required")
    if isinstance(properties, dict) and isinstance(required, list):
        unlisted = [name for name in required if isinstance(name, str) and name not in properties]
        if unlisted:
            schema["properties"] = {**properties, **dict.fromkeys(unlisted, True)}
    schema["additionalProperties"] = False


def _close_tuple(schema: dict) -> None:
    if isinstance(schema.get("prefixItems"), list) and "items" not in schema:
        schema["items"] = False
    elif isinstance(schema.get("items"), list) and "additionalItems" not in schema:
        schema["additionalItems"] = False


def _merged_refs(schema: Any) -> set[str]:
    """The `$ref`s a merge takes in, anywhere in the schema (a name that looks like a merge only keeps more open)."""
    refs: set[str] = set()
    if isinstance(schema, dict):
        keyed = any(key in schema for key in _KEYED)
        parts = schema.get("allOf") if isinstance(schema.get("allOf"), list) else []
        merged = list(parts) if len(parts) > 1 or keyed else []
        if keyed:
            merged += [schema] + [o for key in _ALTERNATIVES if isinstance(schema.get(key), list) for o in schema[key]]
        refs |= {part["$ref"] for part in merged if isinstance(part, dict) and isinstance(part.get("$ref"), str)}
        for value in schema.values():
            refs |= _merged_refs(value)
    elif isinstance(schema, list):
        for value in schema:
            refs |= _merged_refs(value)
    return refs
