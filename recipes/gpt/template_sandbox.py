"""A chat template rendered with a bound on its work: the template comes with a tokenizer folder, someone else's code.

transformers renders chat templates in Jinja's ImmutableSandboxedEnvironment, which stops a template reaching Python's
internals but not from looping for hours or building a string of gigabytes. BoundedTemplate compiles the template in
an environment configured exactly as transformers configures its own (its filters, globals and extensions, copied from
the environment transformers builds), so normal templates render the same text, and charges the rendering:

- a step for each loop iteration and each call (macros included), up to a budget that grows with the messages;
- a size, up to a limit that grows with the conversation's text, checked before `*`, `**`, `%` and str.format make a
  value and after `+` and `~` (which at most multiply what exists by the template's own length), on the numbers given
  to filters that pad (center, indent, format, ...), and on the rendered output as it is produced.

Going past either raises TooCostly; the caller turns any exception into a one-line refusal.
"""

from __future__ import annotations

import functools
import re
import string
from typing import Any

from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

STEPS_PER_MESSAGE = 10_000  # a template's loops over the messages, nested once, stay well within this
SIZE_PER_MESSAGE = 4_096  # the template's own text around each message (headers, a default system prompt)
SIZE_PER_CHARACTER = 4  # the conversation's text, repeated a few times at most by a normal template
MAX_INT_BITS = 1_024  # a template counts messages, it does not need big numbers
ITERATE = "_bounded_iteration"  # the filter every for loop's iterable goes through
SIZED = "_bounded_size"  # the filter every `~` goes through
WIDTH_FILTERS = ("center", "indent", "format", "wordwrap", "truncate", "batch", "slice", "round", "filesizeformat")
DIGITS = re.compile(r"\d+")


class TooCostly(Exception):
    """The template went past its budget of steps or size."""


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat template environment with every loop, call and growing operator charged to a budget."""

    intercepted_binops = frozenset({"+", "*", "**", "%", "//", "/"})

    def __init__(self, model):
        super().__init__(
            trim_blocks=model.trim_blocks,
            lstrip_blocks=model.lstrip_blocks,
            keep_trailing_newline=model.keep_trailing_newline,
            extensions=[type(e) for e in model.extensions.values()],
        )
        self.filters.update(model.filters)
        self.globals.update(model.globals)
        for name in WIDTH_FILTERS:
            self.filters[name] = self._checked_filter(self.filters[name])
        self.filters[ITERATE] = self._iterate
        self.filters[SIZED] = self._sized
        self.steps, self.max_steps, self.max_size = 0, 0, 0

    def start(self, messages: list[dict]) -> None:
        characters = sum(len(m["content"]) for m in messages)
        self.steps = 0
        self.max_steps = STEPS_PER_MESSAGE * (len(messages) + 1)
        self.max_size = SIZE_PER_CHARACTER * characters + SIZE_PER_MESSAGE * (len(messages) + 1)

    # --- charging --------------------------------------------------------------------------------------------
    def _step(self) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            raise TooCostly(f"more than {self.max_steps:,} loop iterations and calls for this conversation")

    def _sized(self, value: Any) -> Any:
        if isinstance(value, (str, list, tuple, dict)) and len(value) > self.max_size:
            raise TooCostly(f"a value of more than {self.max_size:,} items for this conversation")
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise TooCostly(f"a number of more than {MAX_INT_BITS} bits")
        return value

    def _numbers(self, values) -> None:
        for value in values:
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > self.max_size:
                raise TooCostly(f"a width or count of {value:.3g}, more than {self.max_size:,} for this conversation")

    def _format(self, text: str, args) -> None:
        """A format string's own widths (digits in it) and its arguments, before it makes a string of them."""
        self._numbers(int(d) for d in DIGITS.findall(text) if len(d) <= 30)
        if any(len(d) > 30 for d in DIGITS.findall(text)):
            raise TooCostly("a format string with a number of more than 30 digits")
        self._numbers(args)

    # --- hooks -----------------------------------------------------------------------------------------------
    def _iterate(self, iterable):
        for item in iterable:
            self._step()
            yield item

    def _checked_filter(self, function):
        @functools.wraps(function)  # keeps Jinja's pass_context / pass_environment marker
        def checked(*args, **kwargs):
            self._numbers(a for a in list(args[1:]) + list(kwargs.values()) if not isinstance(a, str))
            return self._sized(function(*args, **kwargs))

        return checked

    def _parse(self, source, name, filename):
        """The template's syntax tree, each for loop's iterable through the counting filter, each `~` through the
        size check."""
        return Charged().visit(super()._parse(source, name, filename))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        __self._step()
        __self._numbers(a for a in list(args) + list(kwargs.values()) if not isinstance(a, str))
        return __self._sized(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value):
        """str.format and str.format_map of the template, their widths checked before they make a string."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        text = value.__self__

        def checked(*args, **kwargs):
            for _, _, spec, _ in string.Formatter().parse(text):
                self._format(spec or "", [])
            given = [v for a in args for v in (a.values() if isinstance(a, dict) else [a])]
            self._numbers(v for v in given + list(kwargs.values()) if not isinstance(v, str))
            return self._sized(wrapped(*args, **kwargs))

        return checked

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            self._product(left, right)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if right > 0 and max(abs(left).bit_length() - 1, 0) * right > MAX_INT_BITS:
                raise TooCostly(f"a power of more than {MAX_INT_BITS} bits")
        elif operator == "%" and isinstance(left, str):
            self._format(left, right if isinstance(right, (tuple, list)) else [right])
        return self._sized(super().call_binop(context, operator, left, right))

    def _product(self, left, right) -> None:
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TooCostly(f"a product of more than {MAX_INT_BITS} bits")
            return
        for items, times in ((left, right), (right, left)):
            if isinstance(items, (str, list, tuple)) and isinstance(times, int) and len(items) * times > self.max_size:
                raise TooCostly(f"a repetition of more than {self.max_size:,} items for this conversation")


class Charged(NodeTransformer):
    """Rewrites a template's syntax tree so that its loops and concatenations go through the budget's filters."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, ITERATE, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        return nodes.Filter(self.generic_visit(node), SIZED, [], [], None, None, lineno=node.lineno)


class BoundedTemplate:
    """A chat template's source compiled in a BoundedSandbox configured as transformers configures its own."""

    def __init__(self, source: str):
        from transformers.utils.chat_template_utils import _compile_jinja_template

        # the environment transformers builds, from an empty template: compiling `source` there would evaluate its
        # constant expressions ({{ 10 ** 10000000 }}) unbounded, which BoundedSandbox's intercepted operators prevent
        self.environment = BoundedSandbox(_compile_jinja_template("").environment)
        self.template = self.environment.from_string(source)

    def render(self, messages: list[dict], **variables) -> str:
        """The template's text for `messages` (the other variables as transformers passes them), TooCostly past the
        budget; the output is counted as Jinja produces it."""
        self.environment.start(messages)
        out, size = [], 0
        for piece in self.template.generate(messages=messages, **variables):
            size += len(piece)
            if size > self.environment.max_size:
                raise TooCostly(f"more than {self.environment.max_size:,} characters of output for this conversation")
            out.append(piece)
        return "".join(out)
