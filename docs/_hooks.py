"""MkDocs hooks of the documentation site.

* The repository's executed notebooks are added to the site, so that they
  are rendered from where they live (``notebooks/``) rather than copied into
  ``docs/``.
* The home page is the README, with its links into ``docs/`` made
  relative to the site (``docs/guides/frameworks.md`` is
  ``guides/frameworks.md`` there), so that one text serves GitHub and the
  site and the strict build checks its links.
* Inline code that names a public object (``ls.metrics``,
  ``loss_scale.presets.torch(inner)``, ``lsq.apply_gradients``,
  ``LossScaleState``) links to its API entry, in the guides and in the
  docstrings alike: a cross-reference resolved by mkdocs-autorefs, so that a
  name with no entry fails the strict build.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


# Before mkdocs-jupyter looks at the files, so that it renders these too.
@event_priority(100)
def on_files(files, config):
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        files.append(
            File(
                f"notebooks/{notebook.name}",
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "index.md":
        readme = (ROOT / "README.md").read_text(encoding="utf-8")
        markdown = markdown.replace('--8<-- "README.md"', re.sub(r"\]\(docs/", "](", readme))
    return markdown


def public_names() -> dict[str, str]:
    """``{name as written: identifier}`` for every public object: each name
    of ``loss_scale.__all__``, ``loss_scale.presets``, ``loss_scale.flax`` and
    ``loss_scale.equinox``, as ``loss_scale.X`` and ``ls.X`` (``lsq.X`` for
    Equinox), and the public classes by their bare names."""
    import loss_scale
    import loss_scale.equinox
    import loss_scale.flax
    import loss_scale.presets

    names: dict[str, str] = {}
    for module, aliases in (
        (loss_scale, ("loss_scale", "ls")),
        (loss_scale.presets, ("loss_scale.presets", "ls.presets")),
        (loss_scale.flax, ("loss_scale.flax",)),
        (loss_scale.equinox, ("loss_scale.equinox", "lsq")),
    ):
        for name in module.__all__:
            if name == "presets":
                continue
            identifier = f"{module.__name__}.{name}"
            for alias in aliases:
                names[f"{alias}.{name}"] = identifier
            if module is loss_scale and name[0].isupper():
                names[name] = identifier
    return names


def members(names: dict[str, str]) -> dict[str, str]:
    """``{written: identifier}`` of the public attributes of the public
    classes (``ls.Policy.from_string``, ``RangeReport.max_safe_scale``): links
    made only where the API page has an entry for them."""
    import importlib

    found = {}
    for written, identifier in names.items():
        module, _, name = identifier.rpartition(".")
        obj = getattr(importlib.import_module(module), name)
        if isinstance(obj, type):
            fields = getattr(obj, "_fields", ())
            for attribute in {*vars(obj), *fields}:
                if not attribute.startswith("_"):
                    found[f"{written}.{attribute}"] = f"{identifier}.{attribute}"
    return found


_NAMES: dict[str, str] = {}
_MEMBERS: dict[str, str] = {}
# A code span of text only (no markup inside), starting with a dotted name,
# then nothing, a call or an index: ``ls.metrics``, ``ls.dynamic(inner, ...)``.
_CODE = re.compile(r"<code>(?P<name>[A-Za-z_][\w.]*)(?P<rest>(?:[(\[][^<]*)?)</code>")
# Elements inside which a code span stays as it is: links, headings, code blocks.
_SKIP = re.compile(r"<(/?)(a|h[1-6]|pre|autoref)\b[^>]*>")


def link_code_spans(content: str, names: dict[str, str], optional: dict[str, str]) -> str:
    """``content`` with each code span that names an object of ``names``
    (required) or ``optional`` wrapped in an autorefs cross-reference."""
    out, depth, position = [], 0, 0
    events = sorted(
        [(m.start(), m.end(), "tag", m) for m in _SKIP.finditer(content)]
        + [(m.start(), m.end(), "code", m) for m in _CODE.finditer(content)],
        key=lambda event: event[0],
    )
    for start, end, kind, match in events:
        if start < position:
            continue
        if kind == "tag":
            depth = max(depth + (-1 if match.group(1) else 1), 0)
            continue
        if depth:
            continue
        written = html.unescape(match["name"])
        identifier = names.get(written) or optional.get(written)
        if identifier is None:
            continue
        flag = "" if written in names else " optional"
        out.append(content[position:start])
        out.append(f'<autoref identifier="{identifier}"{flag}>{match.group()}</autoref>')
        position = end
    out.append(content[position:])
    return "".join(out)


def on_page_content(html_content, page, config, files):
    if not _NAMES:
        _NAMES.update(public_names())
        _MEMBERS.update(members(_NAMES))
    return link_code_spans(html_content, _NAMES, _MEMBERS)
