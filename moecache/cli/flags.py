"""Flag types and checks shared by the commands: numeric ranges, the one-line usage errors,
``--version`` (sizes and the KV cache type are parsed by the library: :mod:`moecache.sizes`,
:func:`moecache.settings.kv_cache_type`).

Every bad value ends as one ``error: ...`` line naming the flag and what it accepts: Click's own
range types where they say it clearly (exit 2, as Click's usage errors), :func:`moecache.sizes.parse_size` and
:func:`moecache.sizes.parse_moe_cache` for sizes (ValueError, exit 1 through the commands' error handler).
"""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import typer
import typer.core
from typer.core import TyperGroup

INT32_MAX = 2**31 - 1  # llama.cpp's flags are int32: larger values are refused, not wrapped
SEED_MAX = 2**32 - 1


# ---- one-line usage errors -----------------------------------------------------------------------
# Typer >= 0.2x vendors its own copy of Click (typer._click): its exceptions are not the click
# package's, so the classes come from the Click that typer.core itself uses.
_click = getattr(typer.core, "_click", None)
if _click is None:  # older Typer on the click package
    import click as _click
ClickException = _click.exceptions.ClickException
UsageError = _click.exceptions.UsageError
BadParameter = _click.exceptions.BadParameter
# `moecache` alone prints the help (no_args_is_help): Click raises it as a usage error; it stays as is
_HELP_ERRORS = tuple(c for c in (getattr(_click.exceptions, "NoArgsIsHelpError", None),) if c is not None)


class OneLineUsageError(UsageError):
    """A usage error shown as one ``error: ...`` line (Click prints usage, a hint and ``Error:``)."""

    def show(self, file=None) -> None:  # noqa: ARG002 - always stderr
        typer.echo(f"error: {self.format_message()}", err=True)


def _param_message(e) -> str:
    """``-n/--n-predict: input should be greater than or equal to -1 (valid: -1 to 2147483647)``."""
    param = e.param
    msg = str(e.message).strip()
    msg = re.sub(r"^Value error, ", "", msg)
    msg = msg[:1].lower() + msg[1:] if msg.startswith("Input should") else msg
    lo, hi = getattr(param, "min", None), getattr(param, "max", None)
    if (lo is not None or hi is not None) and "range" not in msg:
        msg += f" (valid: {'-inf' if lo is None else lo} to {'inf' if hi is None else hi})"
    opts = getattr(param, "opts", None) or [getattr(param, "name", "?")]
    return f"{'/'.join(opts)}: {msg}"


def _one_line(e, ctx) -> OneLineUsageError:
    if isinstance(e, BadParameter) and getattr(e, "param", None) is not None:
        msg = _param_message(e)
    else:
        msg = e.format_message().strip().replace("\n", " ")
        if isinstance(e, UsageError):
            path = ctx.command_path if ctx is not None else "moecache"
            msg += f" (`{path} -h` lists the flags)"
    out = OneLineUsageError(msg, ctx)
    out.exit_code = e.exit_code
    return out


class OneLineErrorsGroup(TyperGroup):
    """The app's group: usage errors of the app and of every command become one line."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except (OneLineUsageError, *_HELP_ERRORS):
            raise
        except ClickException as e:
            raise _one_line(e, getattr(e, "ctx", None)) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (OneLineUsageError, *_HELP_ERRORS):
            raise
        except ClickException as e:
            raise _one_line(e, getattr(e, "ctx", None) or ctx) from None


# ---- --version --------------------------------------------------------------------------------------
def version_text() -> str:
    """``moecache 0.1.0 (commit abc1234)``: the installed version and, in a git checkout, its commit."""
    try:
        from importlib.metadata import version

        v = version("moecache")
    except Exception:  # noqa: BLE001 - not installed (run from a checkout)
        v = "unknown"
    root = Path(__file__).resolve().parents[2]  # the checkout (moecache/cli/flags.py)
    commit = ""
    if (root / ".git").exists():
        try:
            commit = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=7",
                                     "--exclude=*"], capture_output=True, text=True, timeout=5).stdout.strip()
        except Exception:  # noqa: BLE001
            commit = ""
    return f"moecache {v}" + (f" (commit {commit})" if commit else "")


def _show_version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit(0)


def version_option():
    """The ``--version`` option of the app and of every command (eager: checked before the others)."""
    return typer.Option("--version", help="Print the version and exit.", is_eager=True, callback=_show_version)


# ---- numeric ranges ---------------------------------------------------------------------------------
def _range_text(lo, hi) -> str:
    if lo is None and hi is None:
        return "any finite number"
    if hi is None:
        return f"x>={lo:g}"
    if lo is None:
        return f"x<={hi:g}"
    return f"{lo:g}<=x<={hi:g}"


def frange(lo: float | None = None, hi: float | None = None):
    """A float flag's parser (typer ``parser=``): finite (nan and inf parse as floats) and in [lo, hi];
    a bad value is one line: ``error: --top-p: 1.5 is not in the range 0<=x<=1.``"""
    def parse(value) -> float:
        if isinstance(value, float):
            v = value
        else:
            try:
                v = float(value)
            except ValueError:
                raise ValueError(f"{value!r} is not a number (valid: {_range_text(lo, hi)})") from None
        if not math.isfinite(v):
            raise ValueError(f"{value} is not a finite number" + ("" if lo is None and hi is None else
                                                                  f" in the range {_range_text(lo, hi)}"))
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError(f"{value} is not in the range {_range_text(lo, hi)}.")
        return v
    parse.__name__ = "float"
    return parse


def minus_one_or_at_least(lo: int, meaning: str):
    """An int flag's parser: ``-1`` (``meaning``) or an int in [lo, int32 max]: ``--chunks 0`` is
    refused, not divided by."""
    def parse(value) -> int:
        try:
            v = int(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a valid integer (valid: -1 = {meaning}, or {lo}..{INT32_MAX})") \
                from None
        if v != -1 and not lo <= v <= INT32_MAX:
            raise ValueError(f"{v} is not valid: give -1 ({meaning}) or a number in [{lo}, {INT32_MAX}]")
        return v
    parse.__name__ = "integer"
    return parse
