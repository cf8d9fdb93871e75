"""Structured output as grammars, on llguidance: one definition for where a request enters
(the gateway checks a constraint before anything is queued) and for the last stage (which
builds a matcher per sequence and masks its logits each step: `worker_svc.execution.structured`).

llguidance was chosen over xgrammar and outlines-core by measurement
(`python -m bench.structured_mask`; docs/structured-output.md): its mask time per step is
on par with xgrammar's, compiles are fast enough per request, and it imports without torch
or transformers, so the gateway checks a schema with the very library the stages use.

JSON is generated without free whitespace (`", "` between items, `": "` after keys, as
Python's `json.dumps` writes it): a model that may emit whitespace anywhere in a JSON
document can emit it for ever, which small models do.
"""

from __future__ import annotations

import functools
import json

from services.sampling import StructuredOutput

# llguidance's JSON options (its "x-guidance" key): no whitespace between tokens but the
# separators', so the output cannot drift into whitespace.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A constraint that does not compile; the message says why (and where, for a grammar)."""


def _llguidance():
    try:
        import llguidance
    except ImportError as exc:  # an install without the structured-output extra
        raise GrammarError("structured output needs the llguidance package (pip install llguidance)") from exc
    return llguidance


def json_schema_text(schema: dict) -> str:
    """The schema with Pagoda's JSON formatting, for llguidance."""
    return json.dumps({**schema, "x-guidance": {**JSON_FORMAT, **schema.get("x-guidance", {})}})


@functools.lru_cache(maxsize=256)
def grammar_text(s: StructuredOutput) -> str:
    """The constraint as an llguidance grammar definition (GrammarError when it is not
    even well formed: a schema that is not a JSON object)."""
    llg = _llguidance()
    if s.kind == "json_object":
        return llg.grammar_from("json_schema", json_schema_text({"type": "object"}))
    if s.kind == "json_schema":
        try:
            schema = json.loads(s.spec)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
        return llg.grammar_from("json_schema", json_schema_text(schema))
    if s.kind == "choice":
        return llg.grammar_from("choice", json.dumps(list(s.choices)))
    return llg.grammar_from(s.kind, s.spec)  # "regex" or "grammar" (Lark or GBNF)


@functools.lru_cache(maxsize=1024)
def check(s: StructuredOutput) -> None:
    """GrammarError saying what is wrong when the constraint does not compile (llguidance's
    own message: the keyword, the regex position, the grammar line)."""
    llg = _llguidance()
    try:
        error = llg.LLMatcher.validate_grammar(grammar_text(s))
    except GrammarError:
        raise
    except (ValueError, TypeError, RuntimeError) as exc:
        error = str(exc)
    if error:
        raise GrammarError(error.strip())
