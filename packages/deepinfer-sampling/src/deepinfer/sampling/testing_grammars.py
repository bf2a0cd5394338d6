"""Test corpus: thirty JSON schemas of real-world shape, regexes and EBNF grammars.

Each regex and EBNF grammar comes with (or is) a Python regex the tests use as an independent
checker of generated text; JSON output is checked with ``testing.check_json_schema``.
"""

import re

_SHORT = {"type": "string", "maxLength": 8}
_WORD = {"type": "string", "pattern": "^[a-z]{1,6}$"}
_INT = {"type": "integer", "minimum": 0, "maximum": 999}
_ADDRESS = {
    "type": "object",
    "properties": {
        "street": _SHORT,
        "city": _WORD,
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
    },
    "required": ["city", "zip"],
    "additionalProperties": False,
}

JSON_SCHEMAS = [
    {"type": "object", "properties": {"name": _SHORT, "age": _INT}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "array", "items": _INT, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"status": {"enum": ["active", "inactive", "banned"]}},
     "required": ["status"]},
    {"type": "object", "properties": {"address": _ADDRESS}, "required": ["address"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _WORD, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.(com|org)$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"id": _INT, "note": {"anyOf": [_SHORT, {"type": "null"}]}},
     "required": ["id", "note"]},
    {"$defs": {"node": {"type": "object", "properties": {"v": _INT}, "required": ["v"]}},
     "type": "object", "properties": {"left": {"$ref": "#/$defs/node"}, "right": {"$ref": "#/$defs/node"}},
     "required": ["left", "right"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100}},
     "required": ["price"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2,
     "items": {"type": "object", "properties": {"sku": _WORD, "qty": _INT}, "required": ["sku", "qty"],
               "additionalProperties": False}}}, "required": ["items"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"a": _INT, "b": _INT, "c": _INT}, "required": ["a"],
     "additionalProperties": False},
    {"type": "array", "prefixItems": [_WORD, _INT, {"type": "boolean"}], "items": False},
    {"type": "object", "properties": {"level": {"const": "debug"}, "msg": _SHORT},
     "required": ["level", "msg"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 1, "maxItems": 2,
     "items": {"type": "array", "items": _INT, "minItems": 2, "maxItems": 2}}}, "required": ["matrix"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
     "shade": {"enum": [1, 2, 3]}}, "required": ["color", "shade"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": _WORD, "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3},
        "address": _ADDRESS}, "required": ["name", "roles"]}}, "required": ["user"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"value": {"anyOf": [_INT, {"type": "boolean"}, _WORD]}},
     "required": ["value"]},
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"},
     "minItems": 3, "maxItems": 3}}, "required": ["flags"]},
    {"type": "object", "properties": {"title": {"type": "string", "minLength": 2, "maxLength": 6},
     "year": {"type": "integer", "minimum": 1900, "maximum": 2100}}, "required": ["title", "year"]},
    {"$defs": {"point": {"type": "object", "properties": {"x": _INT, "y": _INT}, "required": ["x", "y"],
     "additionalProperties": False}}, "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1,
     "maxItems": 3},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {"version": _INT,
     "stable": {"type": "boolean"}}, "required": ["version"]}, "data": {"type": "array", "items": _WORD,
     "maxItems": 2}}, "required": ["meta", "data"]},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{3}$"},
     "verified": {"type": "boolean"}}, "required": ["phone"]},
    {"type": "object", "properties": {"weights": {"type": "array", "items": {"type": "number",
     "minimum": 0, "maximum": 1}, "maxItems": 3}}, "required": ["weights"]},
    {"type": "object", "properties": {"k": {"type": "string", "enum": ["alpha", "beta"]},
     "v": {"anyOf": [{"type": "null"}, _INT]}}, "required": ["k", "v"], "additionalProperties": False},
    {"type": "object", "properties": {"event": {"type": "object", "properties": {"type": {"enum": [
        "click", "view"]}, "at": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"}}, "required": [
        "type", "at"]}, "count": _INT}, "required": ["event"]},
]  # fmt: skip

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(cat|dog|bird)s?",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|net)",
    r"#[0-9a-f]{6}",
    r"(true|false)( and (true|false)){0,2}",
    r"-?[1-9][0-9]{0,3}(\.[0-9]{1,2})?",
    r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}",
    r"\((x|y)( [+*] (x|y)){1,3}\)",
]

# (EBNF, an equivalent Python regex used as the independent checker)
EBNF_GRAMMARS = [
    ('root ::= "(" num (("+" | "-") num){0,4} ")"\nnum ::= [1-9] [0-9]{0,3}',
     r"\([1-9][0-9]{0,3}([+-][1-9][0-9]{0,3}){0,4}\)"),
    ('root ::= item ("," item){0,3}\nitem ::= "a" | "bb" | "ccc"', r"(a|bb|ccc)(,(a|bb|ccc)){0,3}"),
    ('root ::= "SELECT " col (", " col){0,3} " FROM " tbl\ncol ::= "id" | "name" | "age"\ntbl ::= "users" | "orders"',
     r"SELECT (id|name|age)(, (id|name|age)){0,3} FROM (users|orders)"),
    ('root ::= key "=" val (";" key "=" val){0,3}\nkey ::= [a-z]{1,4}\nval ::= [0-9]{1,3}',
     r"[a-z]{1,4}=[0-9]{1,3}(;[a-z]{1,4}=[0-9]{1,3}){0,3}"),
    ('root ::= "<" tag ">" [a-z ]{0,12} "</" tag ">"\ntag ::= "b" | "i"', r"<(b|i)>[a-z ]{0,12}</(b|i)>"),
]  # fmt: skip


def regex_accepts(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text) is not None
