"""Glue between Hydra and multi-process launchers (torchrun, SLURM).

Hydra runs in every rank. Two things must not happen per rank:
  * a separate timestamped output directory for each rank: the `${run_id:}` resolver used in
    `hydra.run.dir` / `hydra.sweep.dir` gives one id that all ranks of a launch agree on;
  * Hydra logs and `.hydra/` files from every rank: ranks other than 0 get Hydra's logging and
    output subdirectory switched off (`prepare_argv`), so they print only warnings and errors.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Collection, Optional
from urllib.parse import quote

from omegaconf import OmegaConf

REPO_DIR = Path(__file__).resolve().parents[2]
RUN_ID_ENV = "RECIPES_RUN_ID"  # the launch's run id, handed to the jobs a Hydra launcher starts (submitit)
SWEPT_KEYS_ENV = "RECIPES_SWEPT_KEYS"  # the keys its command line sweeps, handed to the jobs the same way
_RUN_ID: str | None = None


def _timestamp() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def run_id() -> str:
    """A timestamp shared by every rank of this launch.

    torchrun: rank 0 publishes its timestamp in the launcher's key-value store (the one the process
    group would use) and the others read it. srun without torchrun: the SLURM job id. torchrun
    without an agent store: its rendezvous id. Otherwise the local time.
    """
    global _RUN_ID
    if _RUN_ID is not None:
        return _RUN_ID
    if os.environ.get(RUN_ID_ENV):  # a job started by this launch's Hydra launcher, or requeued later
        _RUN_ID = os.environ[RUN_ID_ENV]
        return _RUN_ID
    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in os.environ:
        import torch.distributed as dist

        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(minutes=5),
        )
        run_id, restart = os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        key = f"recipes/run_id/{run_id}/{restart}"
        if rank == 0:
            store.set(key, _timestamp())
        _RUN_ID = store.get(key).decode()
    elif "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        _RUN_ID = f"slurm-{os.environ['SLURM_JOB_ID']}"
    elif os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":  # torchrun --rdzv-id, the same on every node
        _RUN_ID = os.environ["TORCHELASTIC_RUN_ID"]
    else:
        _RUN_ID = _timestamp()
    return _RUN_ID


def checkpoint_dir() -> str:
    """Default checkpoint.path: the same for every run of one command, so running it again resumes (also after
    SIGTERM, or requeued). The config as it is: outputs/<config>/checkpoints; with command-line overrides that
    make another run (core/config/identity.py:names_run: the model, data, optimization, parallel layout or the
    weights it starts from), outputs/<config>/<those overrides>/checkpoints (`run_folder`), so such a command
    never resumes, or is refused by, the plain command's run. In a multirun sweep, one folder per configuration,
    <sweep dir>/checkpoints/<its overrides that change the result or that the sweep varies>, not per job
    number: a sweep run again with a changed value list resumes each configuration's own job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        name = configuration_name(task_overrides(), swept_keys())
        return str(Path(hydra_cfg.sweep.dir) / "checkpoints" / name)
    return str(Path(run_folder()) / "checkpoints")


def run_folder() -> str:
    """Where a single training run of this command keeps its checkpoints and run directories: outputs/<config>,
    or outputs/<config>/<its overrides that make another run> (`run_name`). predict.py and generate.py, which
    start no run: outputs/<config>."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    folder = Path("outputs") / hydra_cfg.job.config_name
    name = run_name(task_overrides()) if hydra_cfg.job.name == "train" else None
    return str(folder / name if name else folder)


def task_overrides() -> list[str]:
    """The command line's overrides of the config (Hydra's overrides.task) as given: not resolved, since one that
    holds an interpolation (`optim.lr=${data.lr}`) would be resolved in Hydra's node, where its keys are not."""
    from hydra.core.hydra_config import HydraConfig

    return [str(o) for o in OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)]


def config_name() -> Optional[str]:
    """The name of the config Hydra composed for this job (--config-name); None outside Hydra (a caller from Python)."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().job.config_name if HydraConfig.initialized() else None


def run_dir(new_run_dir: str, *, _root_) -> str:
    """hydra.run.dir: for train.py, where the run of checkpoint.path started (recorded in its run.json by rank 0
    of an earlier invocation, which every rank of this one reads before any of them starts), else `new_run_dir`;
    predict.py and generate.py, which only read a checkpoint, always write to a new directory. A checkpoint.path
    that cannot be resolved (an interpolation of a key or variable that is not there) gets a new directory here,
    and the run stops with a config error naming the key once it starts, instead of a traceback from Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf.errors import OmegaConfBaseException

    from core.config.run_record import recorded_run_dir

    if HydraConfig.get().job.name != "train":
        return new_run_dir
    try:
        checkpoint_path = str(_root_.checkpoint.path)
    except OmegaConfBaseException:
        return new_run_dir
    return recorded_run_dir(checkpoint_path, new_run_dir)


def describe_checkpoint_path(cfg) -> None:
    """Say at the start of a single run whose checkpoint.path is the default where its checkpoints go, and why
    there: the same command again resumes them; overrides that make another run gave it a folder of its own."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from core.config.schema import CheckpointConfig

    hydra_cfg = HydraConfig.get()
    given = OmegaConf.to_container(cfg.checkpoint)["path"]
    if hydra_cfg.mode == RunMode.MULTIRUN or given != CheckpointConfig.path or global_rank() != 0:
        return
    plain = Path("outputs") / hydra_cfg.job.config_name / "checkpoints"
    named = run_overrides(task_overrides())
    log = logging.getLogger("train")
    if not named:
        log.info(
            "checkpoints: %s (%s's own folder: the same command again resumes the run)",
            cfg.checkpoint.path,
            hydra_cfg.job.config_name,
        )
    else:
        log.info(
            "checkpoints: %s, a run of its own: %s on the command line change%s the model, data, optimization, "
            "parallel layout or starting weights of %s, so the same command again resumes this run, not %s's "
            "(to continue that one with them instead, set checkpoint.path=%s)",
            cfg.checkpoint.path,
            " ".join(f"{k}={v}" for k, v in sorted(named.items())),
            "s" if len(named) == 1 else "",
            hydra_cfg.job.config_name,
            plain,
            plain,
        )


# Characters an override keeps in a folder name besides letters, digits and _.-~; the others are percent-encoded:
# path separators (/ and \), the comma between overrides, %, NUL, spaces, quotes and what shells or other
# systems treat specially (: * ? $ ...).
NAME_SAFE = "=+[]@"
NAME_MAX = 120  # a longer name is shortened, ending in a hash of the whole
DEFAULT_NAME = "default"  # no override names the configuration


def configuration_name(overrides: list[str], swept: Collection[str] = ()) -> str:
    """A folder name from the command-line overrides that change a run's result (core/config/identity.py) or
    whose key is `swept` (varied by the sweep: two jobs of one sweep that differ only in training.steps must not
    share a folder, or the second resumes the first's checkpoints), sorted: `optim.lr=0.001,seed=2`; `default`
    when there are none. Two different sets of overrides never share a name: each override is percent-encoded
    (`data.root=%2Fdata%2Fa`), so neither a value's `/` nor its `,` can pass for another's; a name longer than
    NAME_MAX becomes its start and a hash of the whole, one character longer than any name kept whole."""
    from core.config.identity import changes_result

    named = [f"{key}={value}" for key, value in _last_values(overrides).items() if changes_result(key) or key in swept]
    return _shortened(",".join(sorted(quote(o, safe=NAME_SAFE) for o in named)) or DEFAULT_NAME)


def run_name(overrides: list[str]) -> Optional[str]:
    """The folder name of a single run's overrides that make it another run (core/config/identity.py:names_run),
    sorted, each as key@value, joined by +: `distributed.tp@2`, `data.root@%2Fdata%2Fa+data@shards`; None for none.
    Unlike a sweep's names, these hold nothing Hydra reads specially in an unquoted value (= , [ ] ~), so the folder
    can be given as it is (checkpoint.init_from=outputs/gpt_sanity/distributed.tp@2/checkpoints). Keys and values are
    percent-encoded but for letters, digits and _ . -, so two different sets of overrides never share a name."""

    def encoded(text: str) -> str:
        return quote(text, safe="").replace("~", "%7E")  # quote leaves ~ as it is

    named = [f"{encoded(key)}@{encoded(value)}" for key, value in run_overrides(overrides).items()]
    return _shortened("+".join(sorted(named))) if named else None


def run_overrides(overrides: list[str]) -> dict[str, str]:
    """{key: value} of the overrides that make a single run another run (core/config/identity.py:names_run)."""
    from core.config.identity import names_run

    return {key: value for key, value in _last_values(overrides).items() if names_run(key)}


def _last_values(overrides: list[str]) -> dict[str, str]:
    """{key: value} of `key=value` overrides (+key, ++key and ~key as key), the last one winning."""
    return dict(o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)


def _shortened(name: str) -> str:
    """A name longer than NAME_MAX as its start and a hash of the whole: one character longer than any name kept."""
    return name if len(name) <= NAME_MAX else name[: NAME_MAX - 12] + "-" + hashlib.sha1(name.encode()).hexdigest()[:12]


def swept_on_command_line(argv: list[str]) -> list[str]:
    """The keys that the command line's overrides sweep (`training.steps=4,6`, `model=a,b`, Optuna's
    `optim.lr=interval(...)`), as Hydra parses them; Hydra's own keys and what is not an override are left out
    (a malformed override, too: Hydra refuses it itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser, keys = OverridesParser.create(), []
    for arg in argv:
        if "=" not in arg or arg.startswith("-"):  # -m, --config-name x
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException:
            continue
        if override.is_sweep_override() and not override.is_hydra_override():
            keys.append(override.get_key_element().lstrip("+~"))
    return keys


def swept_keys() -> set[str]:
    """The keys this multirun varies: its command line's sweeps (read by the launching process, which hands them
    to every job in SWEPT_KEYS_ENV, also to one a Hydra launcher starts elsewhere) and the sweeper's own
    `params` (e.g. Optuna's search space given in a config)."""
    from hydra.core.hydra_config import HydraConfig

    params = HydraConfig.get().sweeper.get("params") or {}
    return set(json.loads(os.environ.get(SWEPT_KEYS_ENV) or "[]")) | {str(key).lstrip("+~") for key in params}


def separate_checkpoint_path(cfg) -> None:
    """In a multirun, a checkpoint.path that is not the default (given on the command line or in a config, e.g.
    on a shared filesystem) is the root of the jobs' checkpoints, as <sweep dir>/checkpoints is by default: each
    job's go under <checkpoint.path>/<configuration_name(its overrides)>. Otherwise every job would write to the
    same folder, and the second would refuse the first's checkpoints as another configuration's."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from core.config.schema import CheckpointConfig

    hydra_cfg = HydraConfig.get()
    given = OmegaConf.to_container(cfg.checkpoint)["path"]  # as written: the default is ${checkpoint_dir:}
    if hydra_cfg.mode != RunMode.MULTIRUN or given == CheckpointConfig.path:
        return
    cfg.checkpoint.path = str(Path(cfg.checkpoint.path) / configuration_name(task_overrides(), swept_keys()))
    if global_rank() == 0:
        logging.getLogger("train").info(
            "this job's checkpoints: %s (checkpoint.path/<its overrides>)", cfg.checkpoint.path
        )


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", run_id)
    if not OmegaConf.has_resolver("repo_dir"):  # for paths of data shipped in this repository
        OmegaConf.register_new_resolver("repo_dir", lambda: str(REPO_DIR))
    if not OmegaConf.has_resolver("checkpoint_dir"):
        OmegaConf.register_new_resolver("checkpoint_dir", checkpoint_dir)
    if not OmegaConf.has_resolver("run_dir"):
        OmegaConf.register_new_resolver("run_dir", run_dir)
    if not OmegaConf.has_resolver("run_folder"):
        OmegaConf.register_new_resolver("run_folder", run_folder)


def global_rank() -> int:
    for var in ("RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def prepare_argv() -> None:
    """Quiet Hydra on every rank but 0 (call before the @hydra.main function)."""
    if global_rank() != 0:
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]


def exit_process(code: int = 0) -> None:
    """Leave without running interpreter teardown.

    After a multi-process gloo run, torch's teardown at interpreter exit sometimes aborts
    ("terminate called without an active exception") although all work finished; the process group is
    already destroyed by then, so skipping the teardown loses nothing.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def export_to_jobs() -> None:
    """What a job started by a Hydra launcher (submitit: a new process, on SLURM maybe another node, run again
    when requeued) needs from this process: the repository on its import path, this launch's run id, so
    its `hydra.sweep.dir` and checkpoint paths are the ones this process resolved, and the keys its command
    line sweeps, which name the jobs' checkpoint folders (the job's own command line is not this one)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_DIR) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR), *paths])
    os.environ.setdefault(RUN_ID_ENV, run_id())
    os.environ[SWEPT_KEYS_ENV] = json.dumps(swept_on_command_line(sys.argv[1:]))  # this command's, not an outer one's


def optimising_sweep() -> bool:
    """Whether this job is a trial of a sweeper that optimises its return value (Optuna)."""
    from hydra.core.hydra_config import HydraConfig

    return "optuna" in str(HydraConfig.get().sweeper.get("_target_", "")).lower()


def check_sweeper(objective_direction: str) -> None:
    """An Optuna sweep: its direction must be training.objective's, and it must not run in several processes
    (torchrun, srun), where every rank would run a sampler of its own proposing its own values. (The ranks of a job
    that hydra-submitit-launcher started run no sampler.)"""
    from hydra.core.hydra_config import HydraConfig

    from core.config.errors import ConfigError

    if not optimising_sweep():
        return
    sweeper = HydraConfig.get().sweeper
    direction = getattr(sweeper.get("direction"), "name", sweeper.get("direction"))  # the plugin's enum, or a str
    if isinstance(direction, str) and direction != objective_direction:
        raise ConfigError(
            f"hydra.sweeper.direction={direction} but training.objective.direction={objective_direction}"
            ": set both (hydra/sweeper=optuna_objective takes the objective's)"
        )
    processes = max(int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("SLURM_NTASKS", "1")))
    if processes > 1 and "SUBMITIT_FOLDER" not in os.environ:
        raise ConfigError(
            "an Optuna sweep in several processes (torchrun, srun): every rank would run its own "
            "sampler. Run the sweep from one process (python train.py -m ...), with "
            "hydra/launcher=slurm to give each trial its own multi-GPU job"
        )


def pass_on_stop_signal(stopped_by: str | None) -> None:
    """After a run saved and stopped on a signal: give the signal to the handler that was installed before the
    loop's, when that is Python code. Under hydra-submitit-launcher that is submitit's handler of the SLURM
    warning signal, which requeues the job (and ends this process); plain torchrun has none, so nothing happens."""
    import signal

    if stopped_by is None or stopped_by not in signal.Signals.__members__:
        return  # not stopped, or stopped because another rank got the signal
    sig = signal.Signals[stopped_by]
    handler = signal.getsignal(sig)
    if callable(handler) and handler is not signal.default_int_handler:
        logging.getLogger("train").info(
            "handing %s to the launcher's handler (%s)", stopped_by, getattr(handler, "__qualname__", handler)
        )
        handler(sig, None)


CHOSEN_CONFIG: Optional[str] = None  # why this process runs the config it does, when the command line named none


def choose_config(config_from_checkpoint: Callable[[list[str]], Optional[tuple[str, str]]] | None) -> None:
    """`--help`: the usage and the configs (exit 0). A command line that names no config (--config-name):
    predict.py and generate.py take the config checkpoint.init_from was trained with (`config_from_checkpoint(argv)`:
    (its name, why that one), None when the command line gives no checkpoint; it exits itself on a checkpoint it
    cannot read), put into sys.argv for Hydra; otherwise one line listing the configs (exit 2)."""
    from core.config import command_line

    argv, script = sys.argv[1:], Path(sys.argv[0]).name
    if command_line.needs_no_config(argv):
        return
    if command_line.wants_help(argv):  # also with --config-name: Hydra's help lists the schemas in its store as options
        print(command_line.usage(script, config_from_checkpoint is not None, command_line.config_name(argv)))
        exit_process(0)
    if command_line.config_name(argv) is not None:
        return
    chosen = config_from_checkpoint(argv) if config_from_checkpoint is not None else None
    if chosen is None:
        print(
            f"config error: {command_line.missing_config(script, config_from_checkpoint is not None)}", file=sys.stderr
        )
        exit_process(2)
    global CHOSEN_CONFIG
    name, CHOSEN_CONFIG = chosen[0], f"--config-name {chosen[0]}: {chosen[1]}"
    sys.argv[1:1] = ["--config-name", name]


def run_hydra(
    hydra_main,
    config_keys: Callable[[list[str]], set[str]] | None = None,
    config_from_checkpoint: Callable[[list[str]], Optional[tuple[str, str]]] | None = None,
) -> None:
    """Run a @hydra.main entry point on this rank: a command line without --config-name answered first
    (`choose_config`), the command line's keys checked against `config_keys(its arguments)` (an unknown one ends with
    exit code 2 and the closest valid key), the resolvers registered, Hydra quiet on ranks > 0, and the process ended
    when it returns or fails, with its exit code (1 for an unexpected error, which Hydra has printed; a multirun with
    failed jobs names them and ends with the first one's code: core/distributed/failed_jobs.py). Ending with os._exit
    keeps a failed run from waiting at interpreter exit for data-loader workers or threads that are still running: a
    failing job ends instead of holding its nodes."""
    from core.config import command_line
    from core.config.errors import ConfigError
    from core.config.overrides import check_overrides
    from core.distributed.watchdog import exit_with_launcher

    choose_config(config_from_checkpoint)
    if config_keys is not None:
        try:
            groups = {p.name for p in (REPO_DIR / "configs").iterdir() if p.is_dir()}
            check_overrides(sys.argv[1:], config_keys(sys.argv[1:]), groups)
            command_line.check_group_choices(sys.argv[1:])  # e.g. data=moby_dick (gpt's) for vit_sanity
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            exit_process(2)
    register_resolvers()
    prepare_argv()
    exit_with_launcher()
    export_to_jobs()
    from core.config.errors import DEBUG_ENV
    from core.distributed.failed_jobs import JobFailed, finish

    # Hydra prints an error of its own (composing the config, a failed multirun job) and exits 1, unless asked to
    # raise it: then it is shown here as one line, exit 2. RECIPES_DEBUG=1 or the user's HYDRA_FULL_ERROR=1: the
    # traceback, as Hydra shows it.
    one_line = not os.environ.get("HYDRA_FULL_ERROR") and not os.environ.get(DEBUG_ENV)
    if one_line:
        os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        hydra_main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
        exit_process(finish(code))
    except BaseException as e:  # noqa: BLE001  (anything Hydra did not report: print it, then end)
        import traceback

        line = command_line.composition_error(e) if one_line else None
        if line is not None:
            print(f"config error: {line}", file=sys.stderr)
            exit_process(finish(2))
        if isinstance(e, JobFailed) and one_line:  # its line was logged when the job failed
            exit_process(finish(1))
        traceback.print_exc()
        exit_process(finish(1))
    exit_process(finish(0))  # a multirun's failed jobs are named, and end it with an error code


# Also on import: a job started by hydra-submitit-launcher unpickles train.py's main (which imports this module)
# and resolves its config without ever running run_hydra.
register_resolvers()
