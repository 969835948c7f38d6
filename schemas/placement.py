"""Where a field belongs: for a field refused as unknown, the nearby place where that name is known.

With --reject-unknown-fields a body refuses a field it does not name
(schemas/body.py), so a field given one level off, such as `max_new_tokens`
beside `parameters` instead of in it, is refused; the error can then say
where it belongs. A place is found by walking the body's models along the
error's location: a name is a field, a number a list's item, anything else a
union member's tag (the value of its `op`, say, or the Tag() a callable
discriminator picks it by) that picks the members it names.
"""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, Tag
from pydantic.fields import FieldInfo

Location = tuple[str | int, ...]


def models_of(annotation: Any) -> list[type[BaseModel]]:
    """The models a value of this annotation can be: itself, a union's members, a list's items, Annotated's type."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = (model for argument in get_args(annotation) for model in models_of(argument))
    return list(dict.fromkeys(found))


def _fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """The model's fields by the names a body uses (an alias where one is set)."""
    return {info.alias or name: info for name, info in model.model_fields.items()}


def _tags(model: type[BaseModel]) -> set:
    """The values of the model's Literal fields: what picks it out of a union."""
    literals = [info.annotation for info in model.model_fields.values() if get_origin(info.annotation) is Literal]
    return {value for literal in literals for value in get_args(literal)}


def _tagged(annotation: Any) -> dict[str, list[type[BaseModel]]]:
    """The members of the unions in this annotation that carry a Tag() (a callable discriminator's), by tag."""
    arguments = get_args(annotation)
    found = {m.tag: models_of(arguments[0]) for m in arguments[1:] if isinstance(m, Tag)}
    for argument in arguments:
        found |= _tagged(argument)
    return found


def _walk(root: Any, location: Location) -> tuple[list[type[BaseModel]], list[int]]:
    """The models the value at `location` can be (none when it is no model, or the walk loses its way), and the
    indexes of the parts a body names: its fields and list items, not the union members' tags pydantic adds."""
    models, named, tags = models_of(root), [], _tagged(root)
    for index, part in enumerate(location):
        if isinstance(part, int):  # an item of a list, whose models the list's field gave already
            named.append(index)
            continue
        tagged = [model for model in models if part in _tags(model)]
        if index > 0 and isinstance(location[index - 1], int) and (part in tags or (len(models) > 1 and tagged)):
            # The member an item of a list of a tagged union is, which pydantic names before the item's fields
            # (and which may be the name of one of them: "text").
            models = tags.get(part, tagged)
            continue
        holders = [model for model in models if part in _fields(model)]
        if holders:
            named.append(index)
            annotations = [_fields(model)[part].annotation for model in holders]
            models = list(dict.fromkeys(m for annotation in annotations for m in models_of(annotation)))
            tags = {tag: members for annotation in annotations for tag, members in _tagged(annotation).items()}
            continue
        if part in tags:  # a callable discriminator's tag (its members may be no models: a list's form)
            models = tags[part]
            continue
        if not tagged:  # no tag: a field none of them has
            named.append(index)
        models = tagged
    return models, named


def as_named(root: Any, location: Location) -> Location:
    """A pydantic error's location in a `root` value as the value names it: without the union members' tags."""
    _, named = _walk(root, location)
    return tuple(location[index] for index in named)


def dotted(location: Location) -> str:
    """A location as a body's field path: "messages.0.role"."""
    return ".".join(str(part) for part in location)


def _takes(models: list[type[BaseModel]], name: str, value: Any) -> bool:
    """Whether one of `models` has a field `name` that `value` fits: an object's names must all be that field's
    model's (`parameters: {"binary_data": false}` does not belong where `parameters` has no such name)."""
    for model in models:
        info = _fields(model).get(name)
        if info is None:
            continue
        inner = models_of(info.annotation)
        if not isinstance(value, dict) or not inner or any(set(value) <= set(_fields(m)) for m in inner):
            return True
    return False


def where_it_belongs(root: Any, location: Location, value: Any) -> str | None:
    """Where the unknown field at `location` of a `root` value, given as `value`, belongs: "in parameters",
    "at the top level".

    None when neither an object inside the one it was given in nor the one around it has a field of that name
    that the value fits.
    """
    *container, name = location
    models, named = _walk(root, tuple(container))
    for model in models:
        for field, info in _fields(model).items():
            if _takes(models_of(info.annotation), name, value):
                return f"in {dotted((*(container[i] for i in named), field))}"
    fields = [index for index in named if isinstance(container[index], str)]
    if not fields:
        return None
    around = tuple(container[: fields[-1]])
    if _takes(_walk(root, around)[0], name, value):
        named_around = as_named(root, around)
        return f"in {dotted(named_around)}" if named_around else "at the top level"
    return None


def discriminator_values(root: Any, location: Location, discriminator: str) -> list:
    """The values of `discriminator` that pick a member of the union at `location`."""
    models, _ = _walk(root, location)
    literals = [_fields(model).get(discriminator) for model in models]
    return [value for info in literals if info is not None for value in get_args(info.annotation)]
