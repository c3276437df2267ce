"""Jinja chat templates as untrusted code: a sandbox with limits on time, size and memory.

A GGUF's ``tokenizer.chat_template`` is code from the file. :class:`LimitedEnvironment` is jinja2's
``ImmutableSandboxedEnvironment`` (no attribute escapes, no mutation of lists/dicts) plus limits,
so that a hostile template ends with :class:`moecache.errors.ChatTemplateError` within seconds:

- **no constant folding** at compile time (``optimized=False``; jinja2 would otherwise evaluate
  ``{{ 10**(10**8) }}`` while compiling), and the operators ``* ** + %`` are intercepted (jinja2
  never folds intercepted operators) and checked before they run: an integer result of at most
  :data:`MAX_INT_BITS` bits, a string or sequence of at most :data:`MAX_SIZE` items, no format
  width or precision of 6+ digits;
- **bounded calls and filters**: the integer arguments that size a result (``range``, widths and
  counts: ``center ljust rjust zfill expandtabs``, the filters in :data:`SIZING_FILTERS`, ``%``
  with a ``*`` width) at most :data:`MAX_INT_ARG` in magnitude, other integers (``"%d" % 128000``)
  free; ``replace``/``join`` checked for their result size first, ``wordwrap``/``urlize`` (whose
  run time grows with the square of a long word) given at most :data:`MAX_SLOW_INPUT` characters,
  every result at most :data:`MAX_SIZE`;
  ``~`` (concatenation) and captured blocks (``{% set %}...``, macros) at most :data:`MAX_SIZE`;
- **bounded work**: every ``for`` loop and call counts a step (at most :data:`MAX_STEPS` per
  render) and checks the deadline (``time_limit`` seconds; compiling included);
- **bounded output**: the template is rendered as a stream, cut at :data:`MAX_OUTPUT` characters;
- **bounded source**: at most :data:`MAX_SOURCE` characters of template text are compiled;
- **bounded memory** (Linux): while compiling or rendering in a process with no other Python
  thread, the address-space limit (``RLIMIT_AS``) is lowered to the current size plus
  :data:`MEMORY_HEADROOM`, so any other runaway allocation fails as ``MemoryError`` instead of
  growing until the OOM killer. The limit is process-wide, so with other threads running (a
  server, the expert cache's workers) it is not set, and the limits above bound the work alone.

The environment is that of transformers' ``apply_chat_template`` (``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, a ``tojson`` filter keeping non-ASCII text, a
``{% generation %}`` tag rendering its body) with the globals llama.cpp (b11434
``common/jinja/value.cpp``, ``common/chat.cpp``) supplies: ``raise_exception(msg)``,
``strftime_now(fmt)``, and the variables ``tools`` (None) and ``enable_thinking`` (true).
"""

from __future__ import annotations

import json
import re
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from functools import wraps
from typing import Any, Iterable, Iterator

import jinja2
import jinja2.runtime
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moecache.errors import ChatTemplateError

MAX_INT_BITS = 4096         # an integer result of * or ** (about 1233 decimal digits)
MAX_SIZE = 4 << 20          # characters of a string / items of a sequence made by the template
MAX_INT_ARG = 100_000       # magnitude of an integer argument to a call or filter
MAX_STEPS = 1_000_000       # loop iterations plus calls, per render
MAX_OUTPUT = 32 << 20       # characters of rendered text
MEMORY_HEADROOM = 512 << 20  # bytes of address space a compile or render may add
TIME_LIMIT = 5.0            # seconds per compile or render
MAX_SOURCE = 256 << 10      # characters of template text (real templates: a few KiB to ~20 KiB)
MAX_SLOW_INPUT = 100_000    # characters given to wordwrap/urlize
SIZING_FILTERS = frozenset(["center", "indent", "wordwrap", "truncate", "batch", "slice", "filesizeformat"])
SIZING_METHODS = frozenset(["center", "ljust", "rjust", "zfill", "expandtabs"])

_BIG_FORMAT_NUMBER = re.compile(r"\d{6,}")


class LimitExceeded(Exception):
    """A limit of :class:`LimitedEnvironment` was reached (reported as ChatTemplateError)."""


class TemplateRaised(Exception):
    """``raise_exception(msg)`` called by a template."""


def _raise_exception(message: Any) -> None:
    raise TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False,
            separators: Any = None) -> str:
    seps = tuple(separators) if isinstance(separators, (list, tuple)) and len(separators) == 2 else None
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=seps)


class GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (Hugging Face's marker of the assistant's tokens
    for training): the body is rendered, the tags are no-ops, as transformers does at inference."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _check_size(value: Any, what: str) -> Any:
    if _size(value) > MAX_SIZE:
        raise LimitExceeded(f"{what} made {_size(value)} items (limit {MAX_SIZE})")
    return value


def _check_int_args(args: Iterable[Any], what: str) -> None:
    for a in args:
        if isinstance(a, int) and abs(a) > MAX_INT_ARG:
            raise LimitExceeded(f"{what} called with {a} (limit {MAX_INT_ARG})")


def _check_format(fmt: Any, what: str) -> None:
    if isinstance(fmt, str) and _BIG_FORMAT_NUMBER.search(fmt):
        raise LimitExceeded(f"{what}: a format with a 6+ digit number")


def _check_replace(s: Any, old: Any, new: Any, what: str) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        n = len(s) + 1 if old == "" else s.count(old)
        if len(s) + n * len(new) > MAX_SIZE:
            raise LimitExceeded(f"{what} would make {len(s) + n * len(new)} characters (limit {MAX_SIZE})")


def _check_join(sep: Any, seq: Any, what: str) -> None:
    if isinstance(sep, str) and isinstance(seq, (list, tuple, str)):
        total = len(sep) * len(seq) + sum(len(x) for x in seq if isinstance(x, str))
        if total > MAX_SIZE:
            raise LimitExceeded(f"{what} would make {total} characters (limit {MAX_SIZE})")


class LimitedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with the limits of this module (see its docstring).

    Use :meth:`limits` around compiling and rendering: it starts the clock and the step count.
    """

    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, time_limit: float = TIME_LIMIT):
        super().__init__(trim_blocks=True, lstrip_blocks=True, optimized=False,
                         extensions=["jinja2.ext.loopcontrols", GenerationTag])
        self.time_limit = time_limit
        self._deadline = float("inf")
        self._steps = 0
        self.filters["tojson"] = _tojson
        self.filters = {name: self._limited_filter(name, f) for name, f in self.filters.items()}
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)

    # -- the clock and the step count --
    @contextmanager
    def limits(self) -> Iterator[None]:
        """Start the deadline and the step count; lower the address-space limit meanwhile."""
        self._deadline, self._steps = time.monotonic() + self.time_limit, 0
        try:
            if threading.active_count() == 1:  # process-wide: never under another thread's feet
                with _memory_limit(MEMORY_HEADROOM):
                    yield
            else:
                yield
        finally:
            self._deadline = float("inf")

    def step(self) -> None:
        self._steps += 1
        if self._steps > MAX_STEPS:
            raise LimitExceeded(f"more than {MAX_STEPS} loop iterations and calls")
        if not self._steps & 255 and time.monotonic() > self._deadline:
            raise LimitExceeded(f"still running after {self.time_limit:g} s")

    def guard_iter(self, it: Iterable[Any]) -> Iterator[Any]:
        """Every ``for`` loop iterates through this (see :meth:`_parse`)."""
        for x in it:
            self.step()
            yield x

    def concat(self, parts: Iterable[Any]) -> str:  # type: ignore[override]
        """Joins captured output (macros, ``{% set %}`` blocks, the whole render when not streamed)."""
        parts = list(parts)
        total = sum(len(p) for p in parts if isinstance(p, str))
        if total > MAX_OUTPUT:
            raise LimitExceeded(f"a block made {total} characters (limit {MAX_OUTPUT})")
        return "".join(parts)

    def concat_strings(self, *parts: Any) -> str:
        """The ``~`` operator."""
        texts = [p if isinstance(p, str) else str(_check_size(p, "~")) for p in parts]
        total = sum(map(len, texts))
        if total > MAX_SIZE:
            raise LimitExceeded(f"~ made {total} characters (limit {MAX_SIZE})")
        return "".join(texts)

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """Parse, then route every ``for`` loop through :meth:`guard_iter` and every ``~`` through
        :meth:`concat_strings` (environment attributes: a template cannot redefine them)."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("guard_iter"), [loop.iter], [], None, None)
        for node in [tree, *tree.find_all(nodes.Node)]:
            for field in node.fields:
                _replace_concat(node, field)
        return tree

    # -- sandbox hooks --
    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.step()
        if operator == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            if abs(left).bit_length() * right > MAX_INT_BITS + 64:
                raise LimitExceeded(f"{left} ** {right} is too large")
        elif operator == "*":
            if _is_int(left) and _is_int(right):
                if abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                    raise LimitExceeded("a product is too large")
            elif _is_int(right) or _is_int(left):
                seq, n = (left, right) if _is_int(right) else (right, left)
                if _size(seq) * max(n, 0) > MAX_SIZE:
                    raise LimitExceeded(f"repeating {_size(seq)} items {n} times (limit {MAX_SIZE})")
        elif operator == "+":
            if _size(left) + _size(right) > MAX_SIZE:
                raise LimitExceeded(f"+ made {_size(left) + _size(right)} items (limit {MAX_SIZE})")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, "%")
            if "*" in left:  # a width or precision taken from the arguments
                _check_int_args(right if isinstance(right, tuple) else [right], "%")
        return _check_size(super().call_binop(context, operator, left, right), operator)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self.step()
        target = getattr(__obj, "__wrapped__", __obj)
        owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
        what = f"{type(owner).__name__}.{name}" if isinstance(owner, str) else (name or "a call")
        if target is range or (isinstance(owner, str) and name in SIZING_METHODS):
            _check_int_args([*args, *kwargs.values()], what)
        if isinstance(owner, str):
            if name in ("format", "format_map"):
                _check_format(owner, what)
            elif name == "replace" and len(args) >= 2:
                _check_replace(owner, args[0], args[1], what)
            elif name == "join" and args:
                if not isinstance(args[0], (list, tuple, str)):
                    args = (list(__self.guard_iter(args[0])), *args[1:])
                _check_join(owner, args[0], what)
        return _check_size(super().call(__context, __obj, *args, **kwargs), what)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.step()
        return super().getitem(obj, argument)

    def _limited_filter(self, name: str, f: Any) -> Any:
        env = self

        @wraps(f)
        def limited(*args: Any, **kwargs: Any) -> Any:
            env.step()
            values = [a for a in args if not isinstance(a, (jinja2.nodes.EvalContext, jinja2.runtime.Context,
                                                            jinja2.Environment))]
            if name in SIZING_FILTERS:
                _check_int_args([*values[1:], *kwargs.values()], f"filter {name}")
            if name in ("wordwrap", "urlize") and values and _size(values[0]) > MAX_SLOW_INPUT:
                raise LimitExceeded(f"filter {name} given {_size(values[0])} characters (limit {MAX_SLOW_INPUT})")
            if name == "format" and values:
                _check_format(values[0], "filter format")
            elif name == "replace" and len(values) >= 3:
                _check_replace(values[0], values[1], values[2], "filter replace")
            elif name == "join" and values:
                seq = values[0] if isinstance(values[0], (list, tuple, str)) else None
                if seq is not None:
                    _check_join(values[1] if len(values) > 1 else kwargs.get("d", ""), seq, "filter join")
            return _check_size(f(*args, **kwargs), f"filter {name}")
        return limited


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _replace_concat(node: nodes.Node, field: str) -> None:
    """Replace a ``Concat`` child (``a ~ b``) of ``node.field`` by a call of ``concat_strings``."""
    def swap(child: Any) -> Any:
        if isinstance(child, nodes.Concat):
            return nodes.Call(nodes.EnvironmentAttribute("concat_strings"), [swap(c) for c in child.nodes],
                              [], None, None, lineno=child.lineno)
        return child
    value = getattr(node, field, None)
    if isinstance(value, list):
        setattr(node, field, [swap(c) for c in value])
    else:
        setattr(node, field, swap(value))


@contextmanager
def _memory_limit(headroom: int) -> Iterator[None]:
    """Lower the soft ``RLIMIT_AS`` to the current address-space size + ``headroom`` (Linux)."""
    try:
        import resource
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * resource.getpagesize()
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        yield
        return
    limit = size + headroom
    if (soft != resource.RLIM_INFINITY and soft <= limit) or (hard != resource.RLIM_INFINITY and hard < limit):
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class CompiledTemplate:
    """A Jinja chat template compiled in a :class:`LimitedEnvironment`.

    Args:
        source: the template text.
        name: how errors name it (``"gguf"``: the GGUF's ``tokenizer.chat_template``, ...).
        time_limit: seconds allowed to compile, and to each render.

    Raises ValueError when it does not compile, :class:`ChatTemplateError` on a limit.
    """

    def __init__(self, source: str, name: str, time_limit: float = TIME_LIMIT):
        self.name = name
        self.env = LimitedEnvironment(time_limit)
        if len(source) > MAX_SOURCE:
            raise self._breach(LimitExceeded(f"{len(source)} characters of template text (limit {MAX_SOURCE})"))
        try:
            with self.env.limits():
                self.template = self.env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template ({name}) does not compile: line {e.lineno}: {e.message}") from None
        except (LimitExceeded, MemoryError, RecursionError) as e:
            raise self._breach(e) from None
        except Exception as e:  # noqa: BLE001 - e.g. Python's SyntaxError on 21 nested loops
            raise ValueError(f"chat template ({name}) does not compile: {type(e).__name__}: {e}") from None

    def _breach(self, e: BaseException) -> ChatTemplateError:
        why = "it needs too much memory" if isinstance(e, MemoryError) else \
            "it recurses too deeply" if isinstance(e, RecursionError) else str(e)
        return ChatTemplateError(f"chat template ({self.name}) stopped: {why}; it may be hostile or broken: "
                                 f"use another one, e.g. --chat-template chatml")

    def render(self, **variables: Any) -> str:
        """The rendered text; ValueError when the template fails or raises, ChatTemplateError on a limit."""
        variables = {"tools": None, "enable_thinking": True, **variables}
        out: list[str] = []
        n = 0
        try:
            with self.env.limits():
                for piece in self.template.generate(**variables):
                    n += len(piece)
                    if n > MAX_OUTPUT:
                        raise LimitExceeded(f"more than {MAX_OUTPUT} characters of output")
                    out.append(piece)
                return "".join(out)
        except (LimitExceeded, MemoryError, RecursionError) as e:
            out.clear()
            raise self._breach(e) from None
        except TemplateRaised as e:
            raise ValueError(f"chat template ({self.name}) refused the messages: {e}") from None
        except Exception as e:  # jinja2 errors, and TypeError etc. from inside the template
            raise ValueError(f"chat template ({self.name}) failed: {type(e).__name__}: {e}") from None
