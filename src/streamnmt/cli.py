"""Command line: parse flags, build the config, call train / translate / eval / bench / export.

Flags are generated from the config dataclasses (see ``configbase.add_args``), so defaults,
validation, YAML keys and flags have one source. Errors the user can fix print one line and exit
non-zero (2 for a bad flag or config value, 1 for a bad input file); no traceback.

Only the command given is imported, and ``train`` checks its flags and config before torch is
imported (:mod:`streamnmt.lazyinit`): ``--help`` and a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import gc
import importlib
import io
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from streamnmt import lazyinit
from streamnmt.configbase import add_args, from_dict
from streamnmt.dist import CaptureFailed, PeerLost, world_from_env
from streamnmt.errors import ConfigError, DeviceError, InputError, NonFiniteLoss

# The packages that hold config classes of ``train`` beside modules that import torch
CONFIG_PACKAGES = ("streamnmt.data", "streamnmt.engine")


def _train(args: dict, parser: argparse.ArgumentParser) -> int:
    from streamnmt import dist

    config_file = args.pop("config", None)
    nproc = args.pop("nproc", None)
    if nproc is not None:
        return _exec_torchrun(nproc, args, config_file, parser)
    resume = args.pop("resume", None)
    try:
        return _run_trainer(args, config_file, resume)
    except Exception as e:
        d = dist.Dist(*dist.world_from_env()[:2], backend="env" if "WORLD_SIZE" in os.environ else None)
        own = (ConfigError, InputError, NonFiniteLoss, DeviceError, PeerLost, CaptureFailed)
        if d.active and not isinstance(e, own) and dist.is_collective_error(e):  # our errors say what they are
            raise dist.peer_lost(d, e) from None
        raise


def _run_trainer(args: dict, config_file: str | None, resume: str | None) -> int:
    from streamnmt.config import RESUME_SETTINGS, build_job

    if resume is not None:
        extra = sorted(set(args) - {"device", *RESUME_SETTINGS})
        if extra or config_file:
            raise ConfigError(f"--resume continues a run with the settings in its checkpoint (it takes new "
                              f"--device and limits only: {', '.join('--' + k.replace('_', '-') for k in RESUME_SETTINGS)}"
                              f"); drop {', '.join('--' + k.replace('_', '-') for k in extra) or '--config'}")
        job = None
    else:
        job = build_job(args, config_file)  # a bad setting stops here, before the trainer's imports
        _pretrain_tokenizers(job)
    _prebuild_kernels(job, resume, args.get("device"))
    lazyinit.finish()
    from streamnmt.training.trainer import Trainer

    if job is None:
        trainer = Trainer.from_checkpoint(resume, device=args.get("device"),
                                          changes={k: args[k] for k in RESUME_SETTINGS if k in args})
    else:
        trainer = Trainer(job)
    result = trainer.train()
    d, stopper = trainer.dist, trainer.evaluator.stopper  # what chose best.pt, and at which step
    # The trainer's CUDA graphs captured NCCL collectives: destroying the process group while they
    # live hangs every rank in destroy_process_group (two GPUs, docs/PERFORMANCE.md), so they go first.
    del trainer
    gc.collect()
    d.close()
    if d.main:  # the done line on every end but a signal's (the job is being stopped); the best line on every end
        best = "" if stopper.best is None else \
            f", best {'dev BLEU' if stopper.metric == 'bleu' else 'val_loss'} {stopper.best:.4f} at step {stopper.best_step}"
        if not result.get("signalled"):
            print(f"done: {result['steps']} steps, lowest val_loss {result['best_val']:.4f}{best}; "
                  f"results in {result['save_dir']}")
        where = stopper.where_best(result["steps"])
        if where:
            print(where)
    return 0


def _exec_torchrun(nproc: str, args: dict, config_file: str | None, parser: argparse.ArgumentParser) -> int:
    """``streamnmt train --nproc N``: check the flags, then run torchrun (``torch.distributed.run``'s
    own entry point, ``--standalone``) in this process, which starts N trainer processes with the
    flags given, less --nproc (:func:`_flags_argv`). A stop by SIGTERM/SIGINT, which torchrun
    forwards to the ranks (they finish the step, rank 0 saves), exits 0; a failed rank exits
    non-zero with one line naming it."""
    import psutil
    import torch

    from streamnmt import dist
    from streamnmt.config import build_job
    from streamnmt.configbase import check

    try:
        n = int(nproc)
    except ValueError:
        raise ConfigError(f"--nproc: must be an integer; got {nproc!r}") from None
    check(n >= 1, "nproc", f"must be at least 1; got {n}")
    check(int(os.environ.get("WORLD_SIZE", "1")) <= 1, "nproc", "this process already runs under torchrun; drop --nproc")
    if args.get("resume") is None:
        job = build_job({k: v for k, v in args.items()}, config_file)  # bad flags: exit 2 before starting
        device, backend = job.run.device, job.engine.dist_backend
    else:  # the ranks run on the checkpoint's device unless --device names another
        saved = _saved_config(args["resume"])
        device = args.get("device") or saved.get("run", {}).get("device")
        backend = saved.get("engine", {}).get("dist_backend", "auto")
    cuda = device.startswith("cuda") if device else torch.cuda.is_available()
    check(backend != "nccl" or cuda, "dist_backend", "nccl needs CUDA devices but the run is on the CPU; "
                                                     "use --dist-backend gloo or auto")
    if cuda:
        check(n <= torch.cuda.device_count(), "nproc",
              f"{n} processes but only {torch.cuda.device_count()} CUDA device(s); one GPU per process")
    given = {**args, **({"config": config_file} if config_file is not None else {})}
    # The ranks count --time-limit from this command's start, not from their own (see
    # stopping.command_start); set for the ranks only, so that a later command of this process
    # (main() called in-process) does not inherit it.
    started = os.environ.get("STREAMNMT_COMMAND_START")
    os.environ["STREAMNMT_COMMAND_START"] = started or str(psutil.Process().create_time())
    try:
        return dist.run_torchrun(n, ["-m", "streamnmt", "train", *_flags_argv(parser, given)])
    finally:
        if started is None:
            del os.environ["STREAMNMT_COMMAND_START"]


def _pretrain_tokenizers(job: Any) -> None:
    """Start training the corpus's missing tokenizers in a child process now (a --data corpus's, or
    the built-in corpus's, which the child writes first where it is not yet:
    :mod:`streamnmt.data.tokenizer_child`): prepare_data waits for it after the imports, the device
    and the recipe. Before the Triton kernels' children, whose start imports torch; this needs no torch."""
    from streamnmt.data.tokenizer_child import start_for

    start_for(job)


def _prebuild_kernels(job: Any, resume: str | None, device: str | None) -> None:
    """Start building the Triton segment kernels in a child process now, where the run's build check
    will build them (:mod:`streamnmt.models.prebuild`): the build overlaps the imports and the set-up
    up to the check. A resumed run: its checkpoint's job, on ``--device`` where given."""
    from streamnmt.config import job_from_dict
    from streamnmt.models import prebuild

    if job is None:
        saved = _saved_config(resume) if resume else {}
        try:
            job = job_from_dict(saved) if saved else None
        except (ConfigError, TypeError, ValueError):
            job = None
        if job is None:  # the trainer says what is wrong with the checkpoint
            return
        if device is not None:
            job.run.device = device
    prebuild.start_for(job)


def _saved_config(path: str) -> dict[str, Any]:
    """The job a checkpoint was trained with, read without loading its tensors (memory-mapped);
    empty where it cannot be read (the ranks then say why, in one line)."""
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return {}
    config = ckpt.get("config") if isinstance(ckpt, dict) else None
    return config if isinstance(config, dict) else {}


def _flags_argv(parser: argparse.ArgumentParser, given: dict[str, Any]) -> list[str]:
    """The command line that ``parser`` parses back into ``given`` (dest -> value as parsed).

    The ranks of ``train --nproc`` get the flags argparse parsed, less --nproc, rebuilt from the
    namespace rather than filtered out of the raw argv by string matching, which only knows the
    spellings it lists. Defaults are SUPPRESSed, so ``given`` holds only the flags the user gave
    (and ``--config``): the ranks apply the same file and the same overrides.
    """
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    argv: list[str] = []
    for dest, value in given.items():
        action = actions[dest]
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else action.option_strings[1])
        elif isinstance(value, list):
            argv += [flag, *value]
        else:  # one token, so that a value starting with '-' cannot be read as a flag
            argv.append(f"{flag}={value}")
    return argv


COMMANDS = (  # (command, module under streamnmt, config class, run function, help)
    ("translate", "inference.translate", "TranslateConfig", "run_translate", "translate lines of text"),
    ("eval", "inference.translate", "EvalConfig", "run_eval", "BLEU and chrF of a checkpoint on a split"),
    ("bench", "bench", "BenchConfig", "run_bench", "benchmark the sync strategies side by side"),
    ("average", "inference.average", "AverageConfig", "run_average", "average the weights of checkpoints"),
    ("export", "inference.export", "ExportConfig", "run_export", "write a checkpoint as a CTranslate2 model"),
)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the usage argparse prints first runs to 30+ lines for train
    and buries the message."""

    takes_any_args = False  # set on a command that failed to import: running it shows the error

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _sub(module: str, cfg_name: str, fn_name: str) -> Callable[[dict], int]:
    def run(args: dict) -> int:
        lazyinit.finish()
        mod = importlib.import_module(f"streamnmt.{module}")
        return getattr(mod, fn_name)(from_dict(getattr(mod, cfg_name), args))
    return run


def _import_failed(command: str, module: str, error: Exception) -> Callable[[dict], int]:
    """The run function of a command whose module did not import: shows why, with the traceback
    (a bug in the command's code is not a usage error, so no one-line message hides it)."""
    def run(args: dict) -> int:
        traceback.print_exception(error)
        print(f"streamnmt: error: the {command} command is unavailable: importing streamnmt.{module} failed "
              f"(traceback above)", file=sys.stderr)
        return 1
    return run


def _add_command(sub: argparse._SubParsersAction, command: str, module: str, cfg_name: str, fn_name: str,
                 help_text: str) -> None:
    """One subcommand, its flags made from its config class. The class is imported now (the flags
    need it); when that fails the command is still offered, and running it shows the error."""
    try:
        cls = getattr(importlib.import_module(f"streamnmt.{module}"), cfg_name)
    except Exception as e:  # noqa: BLE001 -- any bug in one command must neither hide it nor break the others
        p = sub.add_parser(command, help=f"{help_text} [unavailable: its import failed]", allow_abbrev=False,
                           description=f"unavailable: importing streamnmt.{module} failed ({type(e).__name__}: "
                                       f"{e}); run `streamnmt {command}` for the traceback")
        p.set_defaults(_run=_import_failed(command, module, e))
        p.takes_any_args = True
        return
    p = sub.add_parser(command, help=help_text, allow_abbrev=False)
    add_args(p, cls)
    p.set_defaults(_run=_sub(module, cfg_name, fn_name))


TRAIN_HELP = "train a model (built-in English->Chinese corpus without --data)"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``streamnmt`` parser. No parser takes abbreviations (allow_abbrev=False): ``--np 2`` is
    refused instead of silently meaning ``--nproc 2``, and a flag added later cannot change what an
    abbreviation in someone's script means. With ``command``, only that command gets its flags (and
    its module is imported); the others are listed with their help line."""
    parser = _Parser(prog="streamnmt", description="Transformer NMT training that keeps the GPU busy",
                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    if command in (None, "train"):
        from streamnmt.config import SECTIONS

        p = sub.add_parser("train", help=TRAIN_HELP, allow_abbrev=False)
        p.add_argument("--config", default=argparse.SUPPRESS, help="YAML config file; flags override it")
        p.add_argument("--nproc", default=argparse.SUPPRESS, metavar="N",
                       help="train on N processes of this host (one per GPU): starts torchrun for you")
        for name, cls in SECTIONS.items():
            add_args(p.add_argument_group(name), cls)
        p.set_defaults(_run=functools.partial(_train, parser=p))
    else:
        sub.add_parser("train", help=TRAIN_HELP, allow_abbrev=False)
    for name, module, cfg_name, fn_name, help_text in COMMANDS:
        if command in (None, name):
            _add_command(sub, name, module, cfg_name, fn_name, help_text)
        else:
            sub.add_parser(name, help=help_text, allow_abbrev=False)
    return parser


def _command_of(argv: Sequence[str]) -> str:
    """The command ``argv`` names first ("" for none, e.g. ``streamnmt --help``: every command is
    listed, none imported)."""
    names = {"train", *(c[0] for c in COMMANDS)}
    for token in argv:
        if not token.startswith("-"):
            return token if token in names else ""
    return ""


def _unknown_flags(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """argparse's "unrecognized arguments" message, plus the flags each unknown one may mean: an
    abbreviation (no longer accepted) names the flag it abbreviates, a typo the closest flag."""
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for token in unknown:
        if not token.startswith("--"):
            continue
        name = token.split("=", 1)[0]
        close = [f for f in flags if f.startswith(name)][:4] or difflib.get_close_matches(name, flags, n=1)
        if close:
            hints.append(f"{name}: did you mean {' or '.join(close)}?")
    return f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else "")


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> dict[str, Any]:
    """Parse ``argv``; an unknown flag exits 2 with one line from the subcommand's parser, which
    knows the flags to suggest (the top-level parser's own message cannot name them)."""
    namespace, unknown = parser.parse_known_args(argv)
    command_parser = command_parsers(parser)[namespace.command]
    if unknown and not getattr(command_parser, "takes_any_args", False):
        command_parser.error(_unknown_flags(command_parser, unknown))
    return vars(namespace)


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers of ``build_parser()``'s parser, by command."""
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


SILENT_RANK_WAIT_S = 3.0  # a silent rank's wait for rank 0's line (the ranks meet a bad flag within ms)


def _launched_rank() -> int:
    """This process's rank where torchrun started it among others, else 0 (a RANK left in the
    environment of a plain command, or one that is not a number, makes no rank of it)."""
    rank, world, _ = world_from_env()
    return rank if "TORCHELASTIC_RUN_ID" in os.environ or world > 1 else 0


def _let_rank_0_say_it() -> None:
    """A rank other than 0 that stops on a set-up error rank 0 meets too (a bad flag, a bad file)
    says nothing, so the line is printed once; it waits before exiting, because torchrun ends the
    other ranks with SIGTERM as soon as one exits, and a rank 0 a moment behind died unheard."""
    sys.stderr.flush()
    time.sleep(SILENT_RANK_WAIT_S)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command of ``argv``; None: this process's command line (``sys.argv``), whose config
    packages then import torch only once the flags are checked (:mod:`streamnmt.lazyinit`)."""
    if argv is None:
        argv = sys.argv[1:]
        lazyinit.defer(*CONFIG_PACKAGES)
    rank = _launched_rank()  # under torchrun: rank 0 alone says what is wrong
    try:
        with contextlib.redirect_stderr(io.StringIO()) if rank else contextlib.nullcontext():
            args = parse(build_parser(_command_of(argv)), argv)
    except SystemExit as e:
        if rank and e.code:
            _let_rank_0_say_it()
        raise
    run = args.pop("_run")
    args.pop("command")
    try:
        return run(args)
    except (ConfigError, InputError, NonFiniteLoss, DeviceError, PeerLost, CaptureFailed) as e:
        if rank == 0 or isinstance(e, PeerLost):  # a set-up error is the same line on every rank
            print(f"streamnmt: error: {e}", file=sys.stderr)
        elif isinstance(e, (NonFiniteLoss, DeviceError)):  # this rank's own (its loss seen first, its memory)
            print(f"streamnmt: error: rank {rank}: {e}", file=sys.stderr)
        elif isinstance(e, (ConfigError, InputError)):
            _let_rank_0_say_it()
        if isinstance(e, (PeerLost, CaptureFailed)) and "WORLD_SIZE" in os.environ:
            # PeerLost: a collective whose peer died may never finish. CaptureFailed: graphs that
            # captured NCCL collectives may be alive, and tearing down the process group under them
            # hung every rank (docs/PERFORMANCE.md, "Several GPUs (DDP)"). No teardown waits for either.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.exit_code)
        return e.exit_code
    except OSError as e:  # e.g. a run directory that cannot be written, a full disk
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"streamnmt: error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("streamnmt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
