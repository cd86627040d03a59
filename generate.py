"""Continue prompts with a trained language model (a recipe with the generation protocol: the GPT's): texts, or
chat conversations answered with the chat template of the model's tokenizer.

    python generate.py --config-name gpt_sanity checkpoint.init_from=<step dir | .pt | .safetensors> \
        generate.prompt="Call me Ishmael."                                  # sampled (temperature 1)
    python generate.py --config-name gpt_sanity checkpoint.init_from=... generate.prompt_file=prompts.txt \
        generate.greedy=true generate.max_new_tokens=100
    python generate.py --config-name gpt_sft_sanity checkpoint.init_from=<step dir> \
        generate.prompt_file=chats.jsonl        # {"messages": [{"role": "user", "content": "..."}]} per line

The model settings (finetune.mode and the LoRA adapters' finetune.lora.* among them) and the tokenizer come from
the config.yaml of the checkpoint.init_from step folder (core/checkpointing/saved_config.py).

Top to bottom:
  1. setup    - the session and model of train.py (core/session.py) in one process, with whole weights
                (distributed.backend=ddp); weights from checkpoint.init_from, strictly
  2. prompts  - generate.prompt or generate.prompt_file (core/generation/prompts.py): a text tokenized with
                data.tokenizer (the one the training data was made with); a conversation (a .jsonl row's
                "messages", or a text with generate.chat=true) rendered by the recipe's chat template with its
                generation prompt, so the model writes the assistant's reply
  3. decode   - token by token with a KV cache (core/generation/decoding.py): greedy, or sampled with
                temperature, top-k and top-p from generate.seed; until generate.max_new_tokens, the
                end-of-document token or, for a conversation, the template's end of turn; each new token's text
                printed as it comes (generate.stream, core/generation/streaming.py)
  4. write    - each continuation appended to generate.output (default <run dir>/generations.jsonl) as it is done
                (core/generation/generations_file.py): SIGTERM, SIGINT or SIGHUP stops the run after the
                continuation in progress, and the same command with the same generate.output continues after the
                last one written
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from core import session
from core.checkpointing.layout import resolve_checkpoint
from core.checkpointing.saved_config import adopt_saved_model
from core.checkpointing.weights import load_weights
from core.config.errors import ConfigError
from core.config.file_shape import shown
from core.config.validation import to_plain
from core.distributed import launch
from core.distributed.signals import StopSignals
from core.generation.decoding import Sampling, banned_tokens, continue_prompt, sample_generator
from core.generation.generations_file import Appender, continue_output, prompts_identity
from core.generation.prompts import Prompt, Rendered, read_prompts, render_prompts
from core.generation.streaming import TextStream
from core.training.nonfinite import NonFiniteError
from recipes.base import CHAT, GENERATION
from recipes.registry import check_supports, config_keys, get_recipe, predict_configs, register_configs

log = logging.getLogger("generate")

# Each stops the run after the continuation in progress (a second one of the same kind ends it at once).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass
class Generation:
    prompt: str  # the text the model continued (a conversation's: rendered by the chat template)
    sample: int  # which sample of this prompt
    text: str  # the continuation alone (without the token that stopped it)
    new_tokens: int
    # "eod" (the end-of-document token), "end_of_turn" (the chat template's) or "length" (generate.max_new_tokens)
    stop: str
    messages: Optional[list[dict]] = None  # a chat prompt's conversation

    def record(self) -> dict:
        """Its line in generate.output: the fields, "messages" only for a chat prompt."""
        return {k: v for k, v in vars(self).items() if k != "messages" or v is not None}


@hydra.main(version_base="1.3", config_path="configs", config_name=None)
def main(cfg: DictConfig) -> None:
    hydra_config = HydraConfig.get()
    if launch.CHOSEN_CONFIG and launch.global_rank() == 0:  # the command line named no config
        log.info("%s", launch.CHOSEN_CONFIG)
    session.exit_on_error(generate, cfg, Path(hydra_config.runtime.output_dir), list(hydra_config.overrides.task))


def generate(cfg: DictConfig, run_dir: Path, overrides: Sequence[str] = ()) -> list[Generation]:
    """The continuations this invocation makes (those an output it continues held already stay in the file).
    `overrides`: the command line's (Hydra's overrides.task); a model setting given there must be the one the
    checkpoint was trained with. A stop signal ends it after the current continuation with SystemExit(128 + the
    signal's number), once it has said how to continue."""
    gen = cfg.generate
    if not cfg.checkpoint.init_from:
        raise ConfigError("generate.py needs checkpoint.init_from=<step folder | file.pt | file.safetensors>")
    if (gen.prompt is None) == (gen.prompt_file is None):
        raise ConfigError('generate.py needs one of generate.prompt="..." or generate.prompt_file=<file>')
    prompts = [Prompt(gen.prompt)] if gen.prompt is not None else read_prompts(Path(gen.prompt_file))
    register_configs()  # as in train.run: for a caller from Python, which never ran __main__
    cfg = adopt_saved_model(cfg, overrides, get_recipe)
    check_supports(cfg, GENERATION, "generate.py")  # a language model's: GPT's
    if gen.chat or any(p.messages is not None for p in prompts):
        check_supports(cfg, CHAT, "generate.py's chat prompts (generate.chat=true, or messages)")
    stop = StopSignals(STOP_SIGNALS)  # from the start: a signal while the model loads stops before the first prompt
    try:
        with session.start(whole_weights(cfg), run_dir, get_recipe) as sess:
            # 1. The model in one process, its weights from checkpoint.init_from.
            if sess.env.world_size != 1:
                raise ConfigError(
                    f"generate.py runs in one process (started with {sess.env.world_size}): use python, not torchrun"
                )
            # 2. The prompts as token ids (each refused by name before the model loads).
            gen = sess.cfg.generate
            rendered = render_prompts(prompts, sess.recipe, gen.chat)
            parallel, _ = session.build_model(sess, training=False)
            ckpt = sess.cfg.checkpoint
            load_weights(
                parallel,
                ckpt.init_from,
                list(ckpt.init_skip_prefixes),
                ckpt.init_ignore_unexpected,
                True,
                ckpt.verify_checksums,
            )
            # The output: new, or continued after the continuations it holds.
            output = Path(gen.output) if gen.output else run_dir / "generations.jsonl"
            samples = 1 if gen.greedy else gen.samples_per_prompt
            fields = [p.fields() for p in rendered]
            done = continue_output(output, run_settings(sess.cfg, fields), fields, samples)
            # 3. and 4. Each prompt, each sample, printed as it comes and appended when done.
            with Appender(output) as out:
                results = decode(sess, parallel.model.eval(), rendered, samples, done, out, stop)
            report(output, done + len(results), len(prompts), samples, stop.received, explicit=bool(gen.output))
            return results
    finally:
        stop.close()


def decode(
    sess: session.Session,
    model: torch.nn.Module,
    prompts: list[Rendered],
    samples: int,
    start: int,
    out: Appender,
    stop: StopSignals,
) -> list[Generation]:
    """Continuation k = sample k % samples of prompt k // samples, for k from `start` on, each appended to `out`;
    until all are done or a stop signal arrived."""
    recipe, gen = sess.recipe, sess.cfg.generate
    tokenizer = recipe.tokenizer
    sampling = Sampling(gen.greedy, gen.temperature, gen.top_k, gen.top_p)
    banned = banned_tokens(recipe.vocab_size, tokenizer)
    kv_dtype = (sess.runtime.autocast_dtype or torch.float32) if gen.kv_cache else None
    results = []
    for k in range(start, len(prompts) * samples):
        if stop.received:
            break
        (i, j), prompt = divmod(k, samples), prompts[k // samples]
        name = f"prompt {i + 1}" + (f", sample {j + 1}" if samples > 1 else "")
        printer = Printer(name, prompt.text, tokenizer.decode, gen.stream)
        try:
            continuation = continue_prompt(
                recipe,
                model,
                prompt.ids,
                gen.max_new_tokens,
                sess.cfg.model.seq_length,
                sampling,
                None if gen.greedy else sample_generator(gen.seed, i, j),
                banned,
                stop_tokens(recipe, gen.stop_at_eod, chat=prompt.messages is not None),
                sess.env.device,
                sess.autocast,
                kv_dtype,
                printer.push if gen.stream else None,
            )
        except NonFiniteError as e:
            raise NonFiniteError(
                f"{name} ({shown(prompt.text)}): {e}; the weights of "
                f"checkpoint.init_from={sess.cfg.checkpoint.init_from} hold NaN/Inf or their values "
                f"overflow ({k} continuations before it are in {out.path})"
            ) from None
        text = tokenizer.decode(continuation.text_tokens)
        results.append(Generation(prompt.text, j, text, len(continuation.tokens), continuation.stop, prompt.messages))
        out.append(results[-1].record())
        printer.end(results[-1])
    return results


def stop_tokens(recipe, stop_at_eod: bool, chat: bool) -> dict[int, str]:
    """The tokens that end a continuation, and the reason each gives: the end of document; for a chat prompt also
    the template's end of turn (the plain template's is the end of document: its reason, end_of_turn, wins)."""
    if not stop_at_eod:
        return {}
    stops = {recipe.tokenizer.eod: "eod"}
    if chat:
        stops.update({token: "end_of_turn" for token in recipe.end_of_turn_ids()})
    return stops


class Printer:
    """What stdout shows of a continuation: `--- <name>`, the prompt and its continuation (with `stream`, each new
    token's text as it comes: core/generation/streaming.py), then `--- (<why it stopped>, <n> tokens)`."""

    def __init__(self, name: str, prompt: str, decode: Callable, stream: bool):
        self.name, self.prompt = name, prompt
        self.stream = TextStream(decode) if stream else None
        if self.stream:
            print(f"--- {name}\n{prompt}", end="", flush=True)

    def push(self, token: int) -> None:
        piece = self.stream.push(token)
        if piece:
            print(piece, end="", flush=True)

    def end(self, done: Generation) -> None:
        said = f"--- ({done.stop}, {done.new_tokens} tokens)"
        if self.stream:
            print(f"{self.stream.end()}\n{said}", flush=True)
        else:
            print(f"--- {self.name}\n{self.prompt}{done.text}\n{said}", flush=True)


def report(output: Path, done: int, prompts: int, samples: int, stopped_by: Optional[str], explicit: bool) -> None:
    """Say what the output holds; after a stop signal, how to continue, then end with 128 + its number."""
    if not stopped_by or done == prompts * samples:
        log.info("wrote %d continuations of %d prompts to %s", done, prompts, output)
        return
    how = "run the same command again" if explicit else f"run the same command with generate.output={output}"
    log.warning(
        "stopped by %s: %d of %d prompts done (%d continuations in %s); to continue after them, %s",
        stopped_by,
        done // samples,
        prompts,
        done,
        output,
        how,
    )
    raise SystemExit(128 + signal.Signals[stopped_by].value)


def run_settings(cfg: DictConfig, prompts: list[dict]) -> dict:
    """What the continuations depend on, for the output's settings file: the checkpoint (a root or `last` named as
    the step folder it stands for), the prompts (`prompts`: as their records name them; a conversation, made with
    generate.chat or not, by its messages), the decoding, model, tokenizer and precision settings."""
    plain = to_plain(cfg)
    given = ("output", "prompt", "prompt_file", "chat", "stream")  # the prompts' identity, or no part of the text
    return {
        "checkpoint": checkpoint_identity(resolve_checkpoint(cfg.checkpoint.init_from)),
        "prompts": prompts_identity(prompts),
        "generate": {k: v for k, v in plain["generate"].items() if k not in given},
        "model": plain["model"],
        "precision": plain["precision"],
        "data": {k: plain["data"].get(k) for k in ("tokenizer", "eod_token")},
    }


def checkpoint_identity(path: Path) -> dict:
    """The weights as the output's settings file records them: their path, and the size and modification time of
    the file that changes whenever they do (a step folder's COMPLETE marker, a DCP folder's index, a weights file)."""
    changes_with = next((path / name for name in ("COMPLETE", ".metadata") if (path / name).is_file()), path)
    status = changes_with.stat()
    return {"init_from": str(path.resolve()), "bytes": status.st_size, "modified_ns": status.st_mtime_ns}


def whole_weights(cfg: DictConfig) -> DictConfig:
    """The config for one process holding the whole model: a DDP replica (no sharding), fp32 weights;
    FP8 off (TE's KV-cache path runs bf16). The weights are the same whatever the training used."""
    cfg = cfg.copy()
    OmegaConf.set_readonly(cfg, False)  # (a validated config is read-only; this copy is checked again)
    with open_dict(cfg):
        cfg.distributed.backend = "ddp"
        cfg.distributed.dp_shard, cfg.distributed.tp, cfg.distributed.cp = -1, 1, 1
        cfg.precision.param_dtype = "fp32"
        cfg.precision.fp8.enabled = False
    return cfg


if __name__ == "__main__":
    register_configs()
    launch.run_hydra(main, config_keys, lambda argv: session.config_of_init_from(argv, predict_configs()))
