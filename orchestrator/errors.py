"""One-line messages for Hydra/OmegaConf composition errors: the field and the allowed values."""

from __future__ import annotations

import dataclasses
import enum
import re
import typing
from typing import Any, List, Optional

from .moved import moved_line



def _schema_at(path: str, root: type) -> Optional[Any]:
    """The dataclass type at a dotted path of the `root` schema (None past a free-form node)."""
    node: Any = root
    for part in [p for p in path.split(".") if p]:
        if not dataclasses.is_dataclass(node):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            return None
        node = hints[part]
        args = typing.get_args(node)
        if args and type(None) in args:  # Optional[X]
            node = next(a for a in args if a is not type(None))
    return node


def _allowed_keys(parent: str, root: type) -> str:
    node = _schema_at(parent, root)
    if node is not None and dataclasses.is_dataclass(node):
        return ", ".join(f.name for f in dataclasses.fields(node))
    return ""


def _describe(tp: Any) -> str:
    """The values a schema type takes, as a user writes them on the command line."""
    args = typing.get_args(tp)
    if args and type(None) in args:  # Optional[X]
        inner = next(a for a in args if a is not type(None))
        return f"{_describe(inner)}, or null"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return ", ".join(str(e.value) for e in tp)
    origin = typing.get_origin(tp)
    if origin in (list, typing.List):
        return "a list like [a,b]"
    if origin in (dict, typing.Dict) or dataclasses.is_dataclass(tp):
        return "a mapping like {key: value}"
    return {bool: "true, false", int: "an integer", float: "a number", str: "a string"}.get(tp, "")


def _field_type(key: str, root: type) -> Any:
    """The schema type of the dotted `key` (None when it is not a typed field)."""
    parent, _, name = key.rpartition(".")
    node = _schema_at(parent, root)
    if node is None or not dataclasses.is_dataclass(node):
        return None
    return typing.get_type_hints(node).get(name)


def _bad_value(exc: BaseException, key: str, root: type) -> Optional[str]:
    """An OmegaConf ValidationError of a typed field, from its own fields (.full_key, .value):
    `key: 'value' is not valid; allowed: ...` with the values the schema type takes."""
    allowed = _describe(_field_type(key, root))
    if not allowed or not hasattr(exc, "value"):
        return None
    return f"{key}: invalid value '{exc.value}'; allowed: {allowed}"


def _malformed(exc: BaseException, root: type) -> str:
    """Hydra's OverrideParseException (the grammar's text): the override and the form expected."""
    override = str(getattr(exc, "override", ""))
    key = override.split("=", 1)[0].lstrip("+~")
    allowed = _describe(_field_type(key, root)) if key else ""
    form = f"{key}=<{allowed}>" if allowed else "key=value"
    return (f"{key or override}: malformed override '{override}'; expected {form} (a list is [a,b], "
            "a value with special characters quoted: \"key='a value'\")")


def format_error(exc: BaseException, root: type) -> str:
    """Reduce Hydra's multi-line compose errors to `field: problem; allowed: ...`; `root` is the
    config schema (schema.Config), passed in so this module does not import the schema back."""
    chain = [exc]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    text = "\n".join(str(e) for e in chain)
    key = next((getattr(e, "full_key", None) for e in chain if getattr(e, "full_key", None)), None)
    return (_malformed_override(chain, root) or _unknown_choice(text) or _unquoted_commas(text)
            or _unknown_key(text, key, root) or _value_problem(chain, text, key, root)
            or _first_line(exc, key))


def _malformed_override(chain: List[BaseException], root: type) -> Optional[str]:
    """An override Hydra's parser refused (its grammar's words replaced by ours)."""
    from hydra.errors import OverrideParseException

    parse = next((e for e in chain if isinstance(e, OverrideParseException)), None)
    if parse is not None and getattr(parse, "override", None):
        return _malformed(parse, root)
    return None


def _unknown_choice(text: str) -> Optional[str]:
    """A config group given an option it does not have: the options it has."""
    m = re.search(r"Could not find '([^']+)/([^']+)'.*?Available options in '[^']+':\s*(.*)", text, re.S)
    if not m:
        return None
    group, bad, opts = m.group(1), m.group(2), m.group(3)
    options = []
    for line in opts.splitlines():
        line = line.strip()
        if not line or line.startswith("Config search path"):
            if options:
                break
            continue
        if not line.endswith("_schema"):
            options.append(line)
    return f"{group.replace('/', '.')}: unknown choice '{bad}'; allowed: {', '.join(options)}"


def _unquoted_commas(text: str) -> Optional[str]:
    """A value with commas Hydra read as a sweep outside -m: how to quote it."""
    m = re.search(r"Ambiguous value for argument '([^=']+)=([^']*)'", text)
    if not m:
        return None
    # the outer double quotes keep the inner single quotes through a POSIX shell
    return (f"{m.group(1)}: a value with commas must be quoted, e.g. \"{m.group(1)}='{m.group(2)}'\" "
            "(unquoted commas mean a multirun sweep, with -m)")


def _unknown_key(text: str, key: Optional[str], root: type) -> Optional[str]:
    """A key the schema does not have: the keys its parent has, or how to add one to a free-form node."""
    m = re.search(r"Key '([^']+)' (?:not in|is not in struct)", text)
    if not m:
        return None
    full = key or m.group(1)
    given = re.search(rf"\+{re.escape(full)}=(\S+)", text)  # Hydra's hint names the override's value
    moved = moved_line(full, given.group(1) if given else None)
    if moved:
        return moved
    parent = full.rsplit(".", 1)[0] if "." in full else ""
    allowed = _allowed_keys(parent, root)
    if allowed:
        return f"{full}: unknown key in {parent or 'config'}; allowed: {allowed}"
    return f"{full}: not in the config; to add a key to a free-form node write +{full}=..."


def _value_problem(chain: List[BaseException], text: str, key: Optional[str], root: type) -> Optional[str]:
    """A value the field's type refuses (an enum's other word, a number that is not one, a
    validation error), or a required field left without one: what the field allows."""
    m = re.search(r"Invalid value '([^']*)', expected one of \[([^\]]*)\]", text)
    if m and key:
        return f"{key}: invalid value '{m.group(1)}'; allowed: {m.group(2)}"
    m = re.search(r"Value '([^']*)' (?:of type '[^']*' )?could not be converted to (\w+)", text)
    if m and key:
        allowed = _describe(_field_type(key, root))
        return f"{key}: '{m.group(1)}' is not a valid {m.group(2)}" + (f"; allowed: {allowed}" if allowed else "")
    from omegaconf.errors import ValidationError

    missing = re.search(r"[Mm]issing mandatory value", text)
    invalid = next((e for e in chain if isinstance(e, ValidationError) and getattr(e, "full_key", None)), None)
    if invalid is not None and not missing:
        line = _bad_value(invalid, invalid.full_key, root)
        if line:
            return line
    if key and missing:
        example = {"model._target_": "mypkg.nets.Net", "data._target_": "mypkg.data.make_dataset"}.get(key, "...")
        return f"{key}: required, and no value was given; set it, e.g. {key}={example}"
    return None


def _first_line(exc: BaseException, key: Optional[str]) -> str:
    """None of the known shapes: the error's first line, with the key it names."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{key}: {first}" if key and key not in first else first


def config_library_error(exc: BaseException) -> Optional[str]:
    """An error OmegaConf or Hydra raised as a plain Python exception (an AttributeError or
    AssertionError out of their own code, e.g. a mapping merged over a null node) while the config
    was composed: one line naming the key (`full_key` in OmegaConf's message) and the problem;
    None when the exception did not come out of them."""
    tb, inside = exc.__traceback__, False
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        inside = inside or "/omegaconf/" in name or "/hydra/" in name
        tb = tb.tb_next
    if not inside:
        return None
    text = str(exc).strip()
    key = re.search(r"full_key: (\S+)", text)
    first = text.splitlines()[0] if text else type(exc).__name__
    where = f"{key.group(1)}: " if key else ""
    return (f"{where}this override could not be applied ({type(exc).__name__}: {first}); give the whole value, "
            f"e.g. {key.group(1) if key else 'key'}={{_target_: pkg.fn}}, or set it in a config file")
