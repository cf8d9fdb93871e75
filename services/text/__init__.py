"""Text handling shared by the gateway and the offline engine, on `tokenizers` and jinja2.

Never imports torch or transformers, so that the processes that use it start fast and light.

    Tokenizer               a checkpoint's tokenizer and chat templates (tokenizer.py, chat.py)
    IncrementalDetokenizer  token ids -> text deltas that never split a character
    StopStringMatcher       text deltas -> text cut before the first stop string
    TextOutputProcessor     both, for one choice: deltas, finish reason, stop reason
"""

from services.text.chat import ChatTemplateError
from services.text.detokenizer import IncrementalDetokenizer
from services.text.output import FinishReason, TextDelta, TextOutputProcessor
from services.text.stop import StopMatch, StopStringMatcher
from services.text.tokenizer import Tokenizer

__all__ = [
    "ChatTemplateError",
    "FinishReason",
    "IncrementalDetokenizer",
    "StopMatch",
    "StopStringMatcher",
    "TextDelta",
    "TextOutputProcessor",
    "Tokenizer",
]
