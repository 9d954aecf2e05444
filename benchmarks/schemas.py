"""JSON schemas with a request each: the structured-output set of the benchmark (rows `structured_*`)
and of the tests (`tests/e2e/test_structured.py`, `tests/e2e/test_openai_tools.py`).

They cover what applications ask for: nested objects, arrays, enums, numbers and integers with
bounds, optional fields, strings with bounded lengths, booleans, nulls, anyOf. Strings and arrays
are bounded so that a small model's greedy output ends within the requests' max_tokens (a
constrained output cut by max_tokens ends with finish reason `length` and does not parse).
"""

from __future__ import annotations

SYSTEM = "You answer with JSON only."
S = {"type": "string", "maxLength": 40}  # a bounded string
NAME = {"type": "string", "minLength": 1, "maxLength": 30}


def messages(prompt: str) -> list[dict]:
    """A schema request's chat messages (its system message, then the prompt)."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


SCHEMAS: list[tuple[str, str, dict]] = [
    ("person", "Describe a fictional person.",
     _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("book", "Recommend one classic novel.",
     _obj({"title": S, "author": NAME, "year": {"type": "integer", "minimum": 1500, "maximum": 2025}})),
    ("weather", "Give today's weather report for Lisbon.",
     _obj({"city": NAME, "condition": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
           "temperature_c": {"type": "number", "minimum": -50, "maximum": 60}})),
    ("todo", "List three chores for the weekend.",
     _obj({"items": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}})),
    ("address", "Write a postal address in Berlin.",
     _obj({"street": S, "number": {"type": "integer", "minimum": 1, "maximum": 999}, "city": NAME,
           "postcode": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("order", "Create an order for two items from a coffee shop.",
     _obj({"order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
           "items": {"type": "array", "minItems": 1, "maxItems": 2,
                     "items": _obj({"name": NAME, "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                                    "price": {"type": "number", "minimum": 0, "maximum": 100}})}})),
    ("sentiment", "Classify the sentiment of: 'The service was slow but the food was great.'",
     _obj({"sentiment": {"enum": ["positive", "negative", "mixed", "neutral"]},
           "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("movie", "Describe a science fiction film.",
     _obj({"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
           "rating": {"type": "number", "minimum": 0, "maximum": 10}, "sequel": {"type": "boolean"}},
          ["title", "year"])),
    ("contact", "Give the contact card of a plumber.",
     _obj({"name": NAME, "phone": {"type": "string", "pattern": "^\\+?[0-9 ]{7,15}$"},
           "email": {"type": ["string", "null"], "maxLength": 40}})),
    ("recipe", "Give a simple pancake recipe.",
     _obj({"dish": S, "servings": {"type": "integer", "minimum": 1, "maximum": 12},
           "ingredients": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 4}})),
    ("event", "Plan a team meeting next week.",
     _obj({"title": S, "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
           "duration_minutes": {"type": "integer", "minimum": 15, "maximum": 240},
           "remote": {"type": "boolean"}})),
    ("company", "Describe a small software company.",
     _obj({"name": NAME, "employees": {"type": "integer", "minimum": 1, "maximum": 500},
           "headquarters": _obj({"city": NAME, "country": NAME}),
           "public": {"type": "boolean"}})),
    ("flight", "Book a flight from Madrid to Vienna.",
     _obj({"from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
           "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
           "class": {"enum": ["economy", "business", "first"]}})),
    ("review", "Review a pair of running shoes.",
     _obj({"product": S, "stars": {"type": "integer", "minimum": 1, "maximum": 5},
           "pros": {"type": "array", "items": S, "maxItems": 2}, "cons": {"type": "array", "items": S, "maxItems": 2}},
          ["product", "stars"])),
    ("math", "What is 17 times 3? Show the answer.",
     _obj({"expression": S, "result": {"type": "integer"}})),
    ("translation", "Translate 'good morning' into French and Spanish.",
     _obj({"source": S, "translations": _obj({"french": S, "spanish": S})})),
    ("inventory", "List the stock of two products in a warehouse.",
     _obj({"warehouse": NAME, "products": {"type": "array", "minItems": 1, "maxItems": 2,
                                           "items": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                                          "count": {"type": "integer", "minimum": 0, "maximum": 1000}})}})),
    ("tool_choice", "Look up the weather in Osaka, or answer directly.",
     {"anyOf": [_obj({"tool": {"const": "get_weather"}, "arguments": _obj({"city": NAME})}),
                _obj({"answer": S})]}),
    ("status", "Report the status of a server.",
     _obj({"host": NAME, "up": {"type": "boolean"}, "load": {"type": "number", "minimum": 0, "maximum": 100},
           "error": {"type": "null"}})),
    ("student", "Describe a student and their grades in two subjects.",
     _obj({"name": NAME, "grades": {"type": "array", "minItems": 2, "maxItems": 2,
                                    "items": _obj({"subject": NAME,
                                                   "grade": {"enum": ["A", "B", "C", "D", "F"]}})}})),
    ("color", "Pick a colour for a logo.",
     _obj({"name": NAME, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
           "rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
                   "minItems": 3, "maxItems": 3}})),
    ("optional_profile", "Write a short user profile; include a website only if there is one.",
     _obj({"username": {"type": "string", "pattern": "^[a-z0-9_]{3,16}$"}, "bio": S,
           "website": {"type": "string", "maxLength": 40}, "followers": {"type": "integer", "minimum": 0}},
          ["username"])),
]
