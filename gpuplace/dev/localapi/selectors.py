"""Label selectors as kube-apiserver reads them from `?labelSelector=`.

Equality-based (`a=b`, `a==b`, `a!=b`), set-based (`a in (x,y)`, `a notin (x)`) and
existence (`a`, `!a`), comma-separated, all of which must hold. A malformed selector
raises `ValueError` (the server answers 400).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

Matcher = Callable[[Mapping[str, str]], bool]

_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SET = re.compile(rf"\s*({_KEY})\s+(in|notin)\s+\(([^)]*)\)\s*")
_EQUALITY = re.compile(rf"\s*({_KEY})\s*(==|=|!=)\s*({_VALUE})\s*")
_EXISTS = re.compile(rf"\s*(!?)\s*({_KEY})\s*")


def _split(selector: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def _requirement(text: str) -> Matcher:
    match = _SET.fullmatch(text)
    if match:
        key, operator, raw = match.group(1), match.group(3), match.group(4)
        values = frozenset(value.strip() for value in raw.split(",") if value.strip())
        if operator == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    match = _EQUALITY.fullmatch(text)
    if match:
        key, operator, value = match.group(1), match.group(3), match.group(4)
        if operator == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    match = _EXISTS.fullmatch(text)
    if match:
        negate, key = match.group(1) == "!", match.group(2)
        if negate:
            return lambda labels: key not in labels
        return lambda labels: key in labels
    raise ValueError(f"unable to parse requirement: {text.strip()!r}")


def parse(selector: str | None) -> Matcher:
    """A predicate on a label map; the empty selector matches everything."""
    if not selector or not selector.strip():
        return lambda labels: True
    requirements = [_requirement(part) for part in _split(selector)]
    return lambda labels: all(requirement(labels) for requirement in requirements)


def parse_fields(selector: str | None) -> Callable[[Mapping[str, object]], bool]:
    """Field selectors: `a.b=v`, `a.b==v`, `a.b!=v` on dotted paths (e.g. spec.nodeName)."""
    if not selector or not selector.strip():
        return lambda obj: True
    tests: list[tuple[list[str], str, bool]] = []
    for part in selector.split(","):
        match = re.fullmatch(r"\s*([A-Za-z0-9_.]+)\s*(==|=|!=)\s*([^,]*?)\s*", part)
        if not match:
            raise ValueError(f"invalid field selector: {part.strip()!r}")
        tests.append((match.group(1).split("."), match.group(3), match.group(2) == "!="))

    def lookup(obj: Mapping[str, object], path: list[str]) -> str:
        current: object = obj
        for step in path:
            if not isinstance(current, Mapping):
                return ""
            current = current.get(step)
        return "" if current is None else str(current)

    return lambda obj: all((lookup(obj, path) == value) != negate for path, value, negate in tests)


def of_object(selector: object) -> Matcher | None:
    """A `metav1.LabelSelector` object (matchLabels, matchExpressions) as a predicate, as
    `LabelSelectorAsSelector` reads it: None (matches nothing) when it is absent or
    malformed, everything when it is present but empty (`{}`: for a policy/v1
    PodDisruptionBudget, every pod of its namespace, as eviction.go matches it)."""
    if not isinstance(selector, Mapping):
        return None
    terms = [f"{key}={value}" for key, value in (selector.get("matchLabels") or {}).items()]
    for expression in selector.get("matchExpressions") or []:
        if not isinstance(expression, Mapping):
            return None
        key, operator = expression.get("key"), expression.get("operator")
        values = ",".join(str(v) for v in expression.get("values") or [])
        if operator in ("In", "NotIn") and values:
            terms.append(f"{key} {operator.lower()} ({values})")
        elif operator == "Exists":
            terms.append(str(key))
        elif operator == "DoesNotExist":
            terms.append(f"!{key}")
        else:
            return None
    if not terms:
        return lambda labels: True
    try:
        return parse(",".join(terms))
    except ValueError:
        return None
