"""Twenty JSON Schemas for the structured-output tests: nested objects, enums, arrays,
required and optional fields, const, anyOf, nullable values, patterns, $defs.

Every string, array and integer is bounded, so that a random tiny model (which never closes
a string of its own accord) still finishes a document within the tests' max_tokens.
"""

from __future__ import annotations

NAME = {"type": "string", "maxLength": 8}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: list[dict] = [
    # 1. flat object, every field required
    {
        "type": "object",
        "properties": {"name": NAME, "age": SMALL_INT},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    # 2. an enum alone
    {"enum": ["red", "green", "blue"]},
    # 3. booleans and null
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "nothing": {"type": "null"}},
        "required": ["ok", "nothing"],
        "additionalProperties": False,
    },
    # 4. a nested object
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": SMALL_INT, "name": NAME},
                "required": ["id", "name"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    # 5. an array of integers, bounded
    {"type": "array", "items": SMALL_INT, "minItems": 1, "maxItems": 4},
    # 6. an array of enums inside an object
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    # 7. an optional field beside a required one
    {
        "type": "object",
        "properties": {"id": SMALL_INT, "note": NAME},
        "required": ["id"],
        "additionalProperties": False,
    },
    # 8. a const
    {
        "type": "object",
        "properties": {"version": {"const": 2}, "kind": {"const": "event"}},
        "required": ["version", "kind"],
        "additionalProperties": False,
    },
    # 9. anyOf of two shapes
    {
        "anyOf": [
            {"type": "object", "properties": {"cat": NAME}, "required": ["cat"], "additionalProperties": False},
            {"type": "object", "properties": {"dog": SMALL_INT}, "required": ["dog"], "additionalProperties": False},
        ]
    },
    # 10. a nullable field (type list)
    {
        "type": "object",
        "properties": {"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}},
        "required": ["maybe"],
        "additionalProperties": False,
    },
    # 11. a string with a pattern
    {
        "type": "object",
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["zip"],
        "additionalProperties": False,
    },
    # 12. an array of objects
    {
        "type": "array",
        "maxItems": 3,
        "items": {
            "type": "object",
            "properties": {"x": SMALL_INT, "y": SMALL_INT},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    },
    # 13. deep nesting, three levels
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"enum": [1, 2, 3]}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    # 14. $defs and $ref
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": SMALL_INT, "y": SMALL_INT},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
        "required": ["from", "to"],
        "additionalProperties": False,
    },
    # 15. an integer range with negatives
    {
        "type": "object",
        "properties": {"t": {"type": "integer", "minimum": -40, "maximum": 50}},
        "required": ["t"],
        "additionalProperties": False,
    },
    # 16. exclusive bounds (a "number" is not bounded in its digits: a random model never ends one)
    {
        "type": "object",
        "properties": {"p": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 7}},
        "required": ["p"],
        "additionalProperties": False,
    },
    # 17. a bare string with bounds
    {"type": "string", "minLength": 1, "maxLength": 6},
    # 18. an enum of mixed types
    {
        "type": "object",
        "properties": {"v": {"enum": ["on", "off", 0, 1, True, None]}},
        "required": ["v"],
        "additionalProperties": False,
    },
    # 19. a fixed-length tuple (prefixItems)
    {"type": "array", "prefixItems": [NAME, SMALL_INT, {"type": "boolean"}], "items": False, "minItems": 3},
    # 20. a record with many fields of every kind
    {
        "type": "object",
        "properties": {
            "name": NAME,
            "age": SMALL_INT,
            "admin": {"type": "boolean"},
            "role": {"enum": ["dev", "ops"]},
            "skills": {"type": "array", "items": NAME, "maxItems": 2},
            "home": {
                "type": "object",
                "properties": {"city": NAME},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "admin", "role", "skills", "home"],
        "additionalProperties": False,
    },
]

assert len(SCHEMAS) == 20
