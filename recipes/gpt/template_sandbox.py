"""A chat template rendered with a bound on its work: the template comes with a tokenizer folder, someone else's code.

transformers renders chat templates in Jinja's ImmutableSandboxedEnvironment, which stops a template reaching Python's
internals but not from looping for hours or building a string of gigabytes. BoundedTemplate compiles the template in
an environment configured exactly as transformers configures its own (its filters, globals and extensions, copied from
the environment transformers builds), so normal templates render the same text, and charges the rendering:

- a step for each loop iteration and each call (macros included), up to a budget that grows with the messages;
- a size, up to a limit that grows with the conversation's text, checked before `*`, `**`, `%` and str.format make a
  value and after `+` and `~` (which at most multiply what exists by the template's own length), on the numbers given
  to filters that pad (center, indent, format, ...), and on the rendered output as it is produced;
- before they run, what the operations whose result can be the product of their inputs would make (str.replace with
  a long replacement, join with a long separator, indent with a long prefix, tojson with a long indent, ...), and
  the whole size of a list or dict that is about to become text (a filter's, a call's or `%`'s argument, `~`'s
  operand, an output): a list of a few thousand references to one long message is cheap to hold, not to print.

Going past either raises TooCostly; the caller turns any exception into a one-line refusal.
"""

from __future__ import annotations

import functools
import json
import re
import string
from typing import Any

from jinja2 import nodes, pass_context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

STEPS_PER_MESSAGE = 10_000  # a template's loops over the messages, nested once, stay well within this
SIZE_PER_MESSAGE = 4_096  # the template's own text around each message (headers, a default system prompt)
SIZE_PER_CHARACTER = 4  # the conversation's text, repeated a few times at most by a normal template
MAX_INT_BITS = 1_024  # a template counts messages, it does not need big numbers
ITERATE = "_bounded_iteration"  # the filter every for loop's iterable goes through
SIZED = "_bounded_size"  # the filter every `~` goes through
WHOLE = "_bounded_whole"  # the filter each operand of `~` goes through
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
        for name, function in list(self.filters.items()):
            self.filters[name] = self._checked_filter(function, name)
        self.filters[ITERATE] = self._iterate
        self.filters[SIZED] = self._sized
        self.filters[WHOLE] = self._operand
        self.finalize = self._finalized
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

    def _whole(self, values) -> None:
        """Each of `values` that would become text holds no more than the limit (a list's items counted whole)."""
        for value in values:
            if not isinstance(value, str) and held_size(value, self.max_size) > self.max_size:
                raise TooCostly(f"a list or dict of more than {self.max_size:,} items, whole, for this conversation")

    def _growth(self, grows, args, kwargs) -> None:
        """What an operation of these arguments would make, by `grows` (FILTER_GROWS, ...), before it runs."""
        if grows is not None and grows(*args, **kwargs) > self.max_size:
            raise TooCostly(f"a result of more than {self.max_size:,} items for this conversation")

    def _operand(self, value: Any) -> Any:
        self._whole([value])
        return value

    @pass_context  # at run time only: constants (the template's own text) are counted as output
    def _finalized(self, context, value):
        self._whole([value])
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

    def _checked_filter(self, function, name: str):
        skip = 1 if getattr(function, "jinja_pass_arg", None) else 0  # a context or environment comes first
        grows, widths = FILTER_GROWS.get(name), name in WIDTH_FILTERS

        @functools.wraps(function)  # keeps Jinja's pass_context / pass_environment marker
        def checked(*args, **kwargs):
            if name == "join" and len(args) > skip and not isinstance(args[skip], (str, list, tuple, dict)):
                args = (*args[:skip], list(args[skip]), *args[skip + 1 :])  # a generator: counted, then joined
            given = list(args[skip:]) + list(kwargs.values())
            self._whole(given)
            if widths:
                self._numbers(a for a in given[1:] if not isinstance(a, str))
            self._growth(grows, args[skip:], kwargs)
            return self._sized(function(*args, **kwargs))

        return checked

    def _parse(self, source, name, filename):
        """The template's syntax tree, each for loop's iterable through the counting filter, each `~` through the
        size check."""
        return Charged().visit(super()._parse(source, name, filename))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        __self._step()
        __self._numbers(a for a in list(args) + list(kwargs.values()) if not isinstance(a, str))
        __self._whole(list(args) + list(kwargs.values()))
        owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        if isinstance(owner, str) and name in METHOD_GROWS:
            if name == "join" and args and not isinstance(args[0], (str, list, tuple, dict)):
                args = (list(args[0]), *args[1:])  # a generator: counted, then joined
            __self._growth(METHOD_GROWS[name], (owner, *args), kwargs)
        elif name == "generate_lorem_ipsum":
            __self._growth(lorem_size, args, kwargs)
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
            self._whole(given + list(kwargs.values()))
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
            self._whole([right])
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
        node = self.generic_visit(node)
        node.nodes = [nodes.Filter(n, WHOLE, [], [], None, None, lineno=node.lineno) for n in node.nodes]
        return nodes.Filter(node, SIZED, [], [], None, None, lineno=node.lineno)


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


# --- what an operation would make, before it runs ------------------------------------------------------------------
def held_size(value: Any, limit: int) -> int:
    """The items of `value` counted whole (a string's characters, a list's or dict's items and theirs), as its text
    would be long; counting stops past `limit`, so a value of many references to one long string costs little."""
    total, pending = 0, [value]
    while pending and total <= limit:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, (list, tuple)):
            total += len(item) + 1
            pending.extend(item)
        elif isinstance(item, dict):
            total += 2 * len(item) + 1
            pending.extend(item.keys())
            pending.extend(item.values())
        else:
            total += 1
    return total


def _text_size(value: Any) -> int:
    return len(value) if isinstance(value, str) else 0


def replaced_size(s: Any = "", old: Any = "", new: Any = "", count: Any = None, *_, **__) -> int:
    """str.replace and the replace filter: an empty `old` matches before every character and after the last."""
    s, old, new = str(s), str(old), str(new)
    times = len(s) + 1 if not old else s.count(old)
    if isinstance(count, int) and count >= 0:
        times = min(times, count)
    return len(s) + times * max(len(new) - len(old), 0)


def joined_size(items: Any = (), separator: Any = "", *_, **__) -> int:
    """The join filter (items, separator) and str.join (the separator's method: see METHOD_GROWS)."""
    items = items if isinstance(items, (str, list, tuple, dict)) else []
    return sum(_text_size(i) for i in items) + max(len(items) - 1, 0) * len(str(separator))


def indented_size(s: Any = "", width: Any = 4, *_, **__) -> int:
    prefix = len(width) if isinstance(width, str) else int(width) if isinstance(width, (int, float)) else 0
    return len(str(s)) + (str(s).count("\n") + 1) * max(prefix, 0)


def wrapped_size(s: Any = "", width: Any = 79, long_words: Any = True, wrapstring: Any = None, *_, **__) -> int:
    """wordwrap: at most a line a character, each ending with the wrap string."""
    return len(str(s)) * (1 + len("\n" if wrapstring is None else str(wrapstring))) + 1


def json_size(x: Any = None, ensure_ascii: Any = False, indent: Any = None, separators: Any = None, **__) -> int:
    """transformers' tojson: each item of `x` on a line of its own, indented as deep as it lies, with separators
    (`x` itself was held to the limit whole: walking it is cheap)."""
    step = len(indent) if isinstance(indent, str) else int(indent) if isinstance(indent, (int, float)) else 0
    between = sum(len(str(s)) for s in separators) if isinstance(separators, (list, tuple)) else 2
    items, depth, pending = 0, 0, [(x, 1)]
    while pending:
        value, level = pending.pop()
        items, depth = items + 1, max(depth, level)
        children = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
        pending.extend((child, level + 1) for child in children)
    return len(json.dumps(x, default=str)) + items * (1 + max(step, 0) * depth + between)


def expanded_size(s: str, tabsize: Any = 8, *_, **__) -> int:
    return len(s) + s.count("\t") * max(int(tabsize), 0) if isinstance(tabsize, int) else len(s)


def translated_size(s: str, table: Any = None, *_, **__) -> int:
    values = table.values() if isinstance(table, dict) else table if isinstance(table, (list, tuple)) else ()
    return len(s) * max([1] + [len(v) for v in values if isinstance(v, str)])


def lorem_size(n: Any = 5, html: Any = True, min: Any = 20, max: Any = 100, *_, **__) -> int:  # noqa: A002 (its names)
    """lipsum(): n paragraphs of up to `max` words of up to 12 characters and a space."""
    return (n if isinstance(n, int) else 0) * (max if isinstance(max, int) else 0) * 13


FILTER_GROWS = {
    "replace": replaced_size,
    "join": joined_size,
    "indent": indented_size,
    "wordwrap": wrapped_size,
    "tojson": json_size,
}
METHOD_GROWS = {
    "replace": replaced_size,
    "join": lambda separator, items=(), *_, **__: joined_size(items, separator),
    "expandtabs": expanded_size,
    "translate": translated_size,
}
