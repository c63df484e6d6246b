"""Reading a YAML file a user wrote (``--config``): one-line errors naming the file, the line and the
column, and a key given twice in one mapping refused (PyYAML keeps the last silently: a config file
that sets ``max_steps`` twice would train with whichever came later)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml

from streamnmt.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: explicit keys override merged ones
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key: construct_mapping names it
            continue
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"key '{key}' given twice, first on line {first}", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_yaml(path: Path, flag: str) -> Any:
    """The document of a UTF-8 YAML file; errors raise ConfigError naming ``flag`` and the file."""
    if not path.is_file():
        raise ConfigError(f"{flag}: file not found: {path}")
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise ConfigError(f"{flag}: {path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{flag}: {path}: not UTF-8 text (byte {e.start})") from None


def snake_keys(doc: Any, path: Path, flag: str) -> Any:
    """A mapping's keys, and its mappings' keys, with '-' read as '_' (``max-steps``, the flag's
    spelling, is the key ``max_steps``); two spellings of one key in a mapping are refused."""
    if not isinstance(doc, dict):
        return doc
    out: dict[Any, Any] = {}
    spelled: dict[Any, Any] = {}
    for key, value in doc.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if name in out:
            raise ConfigError(f"{flag}: {path}: '{spelled[name]}' and '{key}' are one key given twice")
        out[name], spelled[name] = snake_keys(value, path, flag), key
    return out


def unknown_key(flag: str, path: Path, key: Any, sections: dict[str, list[str]], section: str | None = None
                ) -> ConfigError:
    """The error of a key no setting has (``section``: the one it was given in): the section it
    belongs in where it is another's, else the nearest key of any section."""
    key = str(key)  # YAML reads `1:` or `yes:` as a number or a boolean
    home = next((name for name, keys in sections.items() if key in keys), None)
    where = f"{section}.{key}" if section else key
    if home:
        return ConfigError(f"{flag}: {path}: unknown config key '{where}'; '{key}' belongs in section '{home}'")
    every = {k: name for name, keys in sections.items() for k in keys}
    near = difflib.get_close_matches(key, list(every), n=1)
    hint = f"; did you mean '{near[0]}' (section {every[near[0]]})?" if near else ""
    return ConfigError(f"{flag}: {path}: unknown config key '{where}'{hint}")
