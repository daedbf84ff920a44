"""The error of each matmul precision against the float64 NumPy oracle, on this machine's devices.

    python benchmarks/precision_error.py            # CPU, and the GPU where torch CUDA / JAX GPU exist

docs/tolerances.md's "Matmul precision" table. A float32 model at full precision (impl_jax
`precision="highest"`, torch with TF32 off) against the same model at the device's fast passes
(impl_jax `precision="default"`, torch with `allow_tf32` on for matmuls and cuDNN): d_model 128,
2+2 layers, batch 4, lengths 32, one padded row, three seeds of weights and ids. Per setting, the
worst over the seeds of

    max |logits - oracle| / max(1, max |oracle|)

and whether the logits equal the full-precision ones bit for bit. TF32 is put back as found.
"""

from __future__ import annotations

import numpy as np

from conformance import init_params, preset

SEEDS = (0, 1, 2)


def cases():
    config = preset("paper", d_model=128, n_heads=4, d_ff=512, n_encoder_layers=2, n_decoder_layers=2,
                    src_vocab_size=1000, tgt_vocab_size=1000, max_len=64)
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        src = rng.integers(3, 1000, size=(4, 32))
        tgt = rng.integers(3, 1000, size=(4, 32))
        src[1, 20:] = config.pad_id
        tgt[1, 24:] = config.pad_id
        yield config, init_params(config, seed=seed, dtype=np.float64), src, tgt


def error(got, expected) -> float:
    return float(np.abs(np.asarray(got, np.float64) - expected).max()) / max(1.0, float(np.abs(expected).max()))


def main() -> None:
    import impl_numpy

    rows: dict[str, list] = {}

    def note(label, got, expected, full=None):
        same = None if full is None else np.array_equal(np.asarray(got), np.asarray(full))
        rows.setdefault(label, []).append((error(got, expected), same))

    for config, params, src, tgt in cases():
        expected = impl_numpy.Model(config, params)(src, tgt).logits
        try:
            import jax

            import impl_jax

            for device in ["cpu"] + (["gpu"] if jax.default_backend() == "gpu" else []):
                full = np.asarray(impl_jax.Model(config, params, dtype="float32", device=device)(src, tgt).logits)
                fast = np.asarray(impl_jax.Model(config, params, dtype="float32", device=device,
                                                 precision="default")(src, tgt).logits)
                note(f"impl_jax {device}, precision 'highest'", full, expected)
                note(f"impl_jax {device}, precision 'default'", fast, expected, full)
        except ImportError as exc:
            print(f"(impl_jax skipped: {exc})")
        import torch

        import impl_torch

        for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
            found = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
            model = impl_torch.Model(config, params, dtype="float32", device=device)
            try:
                torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
                with torch.inference_mode():
                    full = model(src, tgt).logits.double().cpu().numpy()
                torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
                with torch.inference_mode():
                    fast = model(src, tgt).logits.double().cpu().numpy()
            finally:
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = found
            note(f"impl_torch {device}, TF32 off", full, expected)
            note(f"impl_torch {device}, TF32 on", fast, expected, full)
    print(f"float32 against the float64 oracle, worst of {len(SEEDS)} seeds (d_model 128, 2+2 layers, B 4, L 32)")
    print(f"{'setting':<40}{'error':>10}  bit-equal to the full-precision row above it")
    for label, found in rows.items():
        same = "" if found[0][1] is None else str(all(same for _, same in found))
        print(f"{label:<40}{max(e for e, _ in found):>10.2e}  {same}")


if __name__ == "__main__":
    main()
