"""The checkpoint-diff document as JSON or YAML (YAML written here: PyYAML is not a dependency).

The YAML is block style, every string double-quoted with JSON's escapes (valid YAML 1.1 and 1.2), every float
written with a decimal point so that YAML 1.1 readers (PyYAML) read it as a float, null for a missing number.
"""

from __future__ import annotations

import json
import math

__all__ = ["render_json", "render_yaml"]


def render_json(document: dict[str, object]) -> str:
    """Indented JSON (no NaN or infinity: the document has none)."""
    return json.dumps(document, indent=2, allow_nan=False) + "\n"


def render_yaml(document: dict[str, object]) -> str:
    """Block-style YAML of a JSON-ready document."""
    return "\n".join(_yaml_lines(document, 0)) + "\n"


def _scalar(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "null"
        text = repr(value)
        if "." not in text and "e" in text:  # 1e-05 is a string to YAML 1.1: 1.0e-05 is a float to both
            mantissa, exponent = text.split("e")
            text = f"{mantissa}.0e{exponent}"
        return text if "." in text or "e" in text else f"{text}.0"
    return json.dumps(str(value), ensure_ascii=True)


def _yaml_lines(value: object, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return [pad + "{}"]
        lines = []
        for key, item in value.items():
            name = json.dumps(str(key), ensure_ascii=True)
            if isinstance(item, (dict, list)) and item:
                lines += [f"{pad}{name}:", *_yaml_lines(item, indent + 2)]
            else:
                lines.append(f"{pad}{name}: {_inline(item)}")
        return lines
    if isinstance(value, list):
        if not value:
            return [pad + "[]"]
        lines = []
        for item in value:
            if isinstance(item, (dict, list)) and item:
                nested = _yaml_lines(item, indent + 2)
                lines.append(f"{pad}- {nested[0].lstrip()}")
                lines += nested[1:]
            else:
                lines.append(f"{pad}- {_inline(item)}")
        return lines
    return [pad + _scalar(value)]


def _inline(value: object) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)
