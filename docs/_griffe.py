"""A Griffe extension for the API pages: the fields of the public NamedTuples
and dataclasses are documented as fields.

Inspected at run time, a NamedTuple field is a ``_tuplegetter`` whose
docstring is "Alias for field number N", and a dataclass field is a class
attribute without a docstring. Their meaning is written once, in the
class's ``Attributes:`` section; this extension moves each entry of that
section onto the field itself (its description, and its annotation from the
class), so that every field has its own entry and anchor
(``loss_scale.StepRecord.grad_max``), and drops the section from the class's
docstring so that nothing is said twice.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import typing
from typing import Any

import griffe

_SECTION = re.compile(r"^Attributes:[ \t]*$")


def _fields(obj: type) -> dict[str, Any]:
    """``{name: annotation}`` of the fields a NamedTuple or a dataclass
    declares itself (not those of its bases)."""
    annotations = inspect.get_annotations(obj)
    if issubclass(obj, tuple) and hasattr(obj, "_fields"):
        names = obj._fields
    elif dataclasses.is_dataclass(obj):
        names = [field.name for field in dataclasses.fields(obj)]
    else:
        return {}
    return {name: annotations[name] for name in names if name in annotations}


def _annotation(annotation: Any, parent: griffe.Object) -> str | griffe.Expr | None:
    """An annotation as written, parsed as Griffe parses source, so that its
    names link (NamedTuple turns the strings of ``from __future__ import
    annotations`` into ``ForwardRef`` objects)."""
    if annotation is None:
        return None
    if isinstance(annotation, typing.ForwardRef):
        annotation = annotation.__forward_arg__
    elif not isinstance(annotation, str):
        annotation = inspect.formatannotation(annotation)
    return griffe.safe_get_annotation(ast.parse(annotation, mode="eval").body, parent=parent) or annotation


def _without_attributes_section(text: str) -> str:
    """The docstring ``text`` (dedented) without its ``Attributes:`` section."""
    lines = text.splitlines()
    kept, skipping = [], False
    for i, line in enumerate(lines):
        if _SECTION.match(line):
            skipping = True
            continue
        if skipping:
            indented = line.startswith((" ", "\t"))
            blank_inside = not line.strip() and i + 1 < len(lines) and lines[i + 1].startswith((" ", "\t"))
            if indented or blank_inside:
                continue
            skipping = False
        kept.append(line)
    return "\n".join(kept).strip("\n")


def _lineno(member: griffe.Object | griffe.Alias) -> float:
    try:
        return member.lineno if member.lineno is not None else float("inf")
    except griffe.AliasResolutionError:
        return float("inf")


def _in_source_order(cls: griffe.Class) -> None:
    """Reorders the class's members as they are written. A class rendered
    through an alias (``loss_scale.LossScaleState`` for
    ``loss_scale._state.LossScaleState``) has members without line numbers,
    which ``members_order: source`` then leaves in insertion order: make that
    the source order."""
    ordered = sorted(cls.members.items(), key=lambda item: _lineno(item[1]))
    cls.members.clear()
    cls.members.update(ordered)


class FieldsAsMembers(griffe.Extension):
    """Documents NamedTuple and dataclass fields from the class's
    ``Attributes:`` section, gives properties their getter's return type,
    and lists every class's members in source order."""

    def on_class_members(self, *, node: Any, cls: griffe.Class, agent: Any, **kwargs: Any) -> None:
        obj = getattr(node, "obj", None)
        if not inspect.isclass(obj):
            return
        if cls.docstring is not None:
            self._document_fields(obj, cls)
        for name, value in vars(obj).items():  # a property's type is its getter's return type
            member = cls.members.get(name)
            if isinstance(value, property) and member is not None and member.annotation is None:
                returns = inspect.get_annotations(value.fget).get("return") if value.fget else None
                member.annotation = _annotation(returns, cls)
        _in_source_order(cls)

    def _document_fields(self, obj: type, cls: griffe.Class) -> None:
        fields = _fields(obj)
        described = {
            element.name: element
            for section in cls.docstring.parse("google")
            if section.kind is griffe.DocstringSectionKind.attributes
            for element in section.value
        }
        if not fields or not described:
            return
        source, start = inspect.getsourcelines(obj)
        lines = {}  # where each field is declared, for members_order: source
        for i, line in enumerate(source):
            declared = re.match(r"^\s+(\w+)\s*:", line)
            if declared and declared.group(1) in fields:
                lines.setdefault(declared.group(1), start + i)
        unknown = sorted(set(described) - set(fields))
        if unknown:
            raise ValueError(f"{cls.path}: the Attributes section names {unknown}, which are not fields")
        for name, annotation in fields.items():
            entry = described.get(name)
            if entry is None:
                raise ValueError(f"{cls.path}: the field {name!r} is not described in the Attributes section")
            member = cls.members.get(name)
            if member is None:
                member = griffe.Attribute(name, parent=cls)
                cls.set_member(name, member)
            if issubclass(obj, tuple):
                member.value = None  # the _tuplegetter
            member.docstring = griffe.Docstring(entry.description, parent=member)
            member.annotation = _annotation(annotation, cls)
            member.lineno = member.endlineno = lines.get(name, cls.lineno)
            member.labels = {"field"}
        cls.docstring = griffe.Docstring(_without_attributes_section(cls.docstring.value), parent=cls)
