"""`fivefold <verb>`: each verb lives in its own module exposing `add_arguments(parser)` and `run(args)`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import typing

from fivefold import faults
from fivefold.config import one_line, shown
from fivefold.errors import EXIT_ENVIRONMENT, CliError, ConfigError, EnvironmentFailure

# verb -> (module, one-line help); modules are imported only when their verb runs or --help is asked
VERBS: dict[str, tuple[str, str]] = {
    "train": ("fivefold.cli.train", "train a model (defaults: the built-in corpus on the tiny model)"),
    "data": ("fivefold.data.cli", "prepare token shards from text, JSONL or Parquet files"),
    "models": ("fivefold.models.cli", "list the model presets with their parameter counts"),
    "export": ("fivefold.models.hf_cli", "export a checkpoint as a Hugging Face Llama directory"),
    "generate": ("fivefold.models.generate", "sample text from a checkpoint or a Hugging Face directory"),
    "plan": ("fivefold.cli.plan", "search the parallel layouts of a model on a cluster: memory, step time, MFU"),
    "calibrate": ("fivefold.tools.calibrate", "measure this machine's compute and collectives; write a hardware "
                  "profile for the planner"),
    "bench": ("fivefold.tools.bench", "time the training step on synthetic tokens (tokens/s, MFU, memory)"),
    "sweep": ("fivefold.sweep.cli", "run a grid of layouts, each for a few timed steps, into a results store"),
    "report": ("fivefold.sweep.report", "plots and an HTML page from a sweep's results store"),
}


class Parser(argparse.ArgumentParser):
    """argparse, with its refusals in one line (`fivefold VERB: error: argument --flag: ...`, exit status 2) like
    every other refusal: no usage block, which `--help` prints."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def _negative_values(argv: list[str]) -> list[str]:
    """`--opt -1,2` as `--opt=-1,2`: argparse reads a value that starts with '-' and is not a plain number (a list
    like '-1,2', '-3e4') as an option and says "expected one argument"; no option starts with a digit, so such a
    token is the value of the option before it, which then gets the value's own error."""
    out: list[str] = []
    for token in argv:
        if (len(token) > 1 and token[0] == "-" and (token[1].isdigit() or token[1] == ".") and out
                and out[-1].startswith("--") and "=" not in out[-1]):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def refuse_empty(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A value given as '' (or blanks) to an option or argument whose default is another: refused naming it, before
    the verb runs, rather than read as "left out" (`--hf ''` as the current directory, `bench --config ''` as no
    config, a data INPUT '' as every file here). Options whose default is '' (`generate --prompt`) keep it."""
    for action in parser._actions:  # noqa: SLF001 (argparse lists its arguments only here)
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001 (`fivefold data prepare|info`)
            chosen = getattr(args, action.dest, None)
            if chosen in action.choices:
                refuse_empty(action.choices[chosen], args)
            continue
        value = getattr(args, action.dest, None)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and not item.strip() and item != action.default:
                if action.option_strings:
                    name = max(action.option_strings, key=len)
                    raise CliError(f"{name} {shown(item)} is empty; give a value or leave the option out")
                name = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
                raise CliError(f"{name} {shown(item)} is empty; give a value")


def main(argv: list[str] | None = None) -> int:
    typed = sys.argv[1:] if argv is None else None  # the program's own command line (a verb may restart it)
    argv = _negative_values(sys.argv[1:] if argv is None else argv)
    parser = Parser(prog="fivefold", description="Plan and train Llama-style models.")
    from fivefold import __version__

    parser.add_argument("--version", action="version", version=f"fivefold {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    verb = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in VERBS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == verb:
            importlib.import_module(module_name).add_arguments(p)
    if verb is None and not argv:
        parser.print_help()
        return 0
    if verb is not None and verb not in VERBS:
        parser.error(f"unknown verb {shown(verb)}; choose one of: {', '.join(VERBS)}")
    args, extra = parser.parse_known_args(argv)
    if args.verb is None:
        parser.print_help()
        return 0
    args.command_line = typed
    module = importlib.import_module(VERBS[args.verb][0])
    if extra and not getattr(module, "ACCEPTS_OVERRIDES", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(module, "ACCEPTS_OVERRIDES", False):
        args.overrides = extra
    try:
        refuse_empty(sub.choices[args.verb], args)
        return int(module.run(args) or 0)
    except (ConfigError, CliError) as e:
        print(f"fivefold {args.verb}: error: {one_line(str(e))}", file=sys.stderr)
        faults.record_failure(f"{e}", peer=False)
        return 2
    except EnvironmentFailure as e:
        if str(e):
            print(f"fivefold {args.verb}: error: {one_line(str(e))}", file=sys.stderr)
        faults.record_failure(f"{e}", peer=e.peer or not str(e))
        return EXIT_ENVIRONMENT
    except faults.StopSignal as e:  # SIGTERM or SIGHUP outside a training loop: cleaned up as after Ctrl-C
        print(f"fivefold {args.verb}: stopped by {e.name}" + (f"; {e.after}" if e.after else ""), file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:  # Ctrl-C: stop without a traceback
        print(f"fivefold {args.verb}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into a reader that stopped early (`| head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
