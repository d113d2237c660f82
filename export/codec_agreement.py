"""How closely a codec bundle of another weight dtype decodes like the fp32 one: waveform SNR, a log-mel
distance, and whether its encoder still gives the same codes.

    python -m export.codec_agreement --ref BUNDLE_FP32 --bundle BUNDLE_X [--golden CODEC_NPZ ...]
                                     [--frames 50 --seed 0]

With ``--golden`` the clip's waveform is encoded by both bundles (codes compared) and its golden codes
decoded by both; without, ``--frames`` random codes are decoded (a random checkpoint has no meaningful audio
to encode). The codes the TTS model makes do not depend on the codec: only decoding does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

# log-mel analysis: 1024-point Hann STFT, hop 256, 80 HTK-mel bands from 0 to Nyquist, log10 of power
N_FFT, HOP, N_MELS, LOG_FLOOR = 1024, 256, 80, 1e-10


def snr_db(ref: np.ndarray, x: np.ndarray) -> float:
    """Signal-to-noise ratio of ``x`` against ``ref`` in dB (inf when identical)."""
    ref, x = np.asarray(ref, np.float64).ravel(), np.asarray(x, np.float64).ravel()
    noise = float(np.sum((x - ref) ** 2))
    return float("inf") if noise == 0 else 10.0 * float(np.log10(np.sum(ref ** 2) / noise))


def _mel_filters(sample_rate: int) -> np.ndarray:
    """[N_MELS, N_FFT/2+1] triangular HTK-mel filters."""
    mel = lambda f: 2595.0 * np.log10(1.0 + f / 700.0)
    hz = lambda m: 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    edges = hz(np.linspace(0.0, mel(sample_rate / 2), N_MELS + 2))
    bins = np.linspace(0.0, sample_rate / 2, N_FFT // 2 + 1)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    return np.maximum(0.0, np.minimum((bins - lo) / (mid - lo), (hi - bins) / (hi - mid)))


def log_mel(x: np.ndarray, sample_rate: int) -> np.ndarray:
    """[frames, N_MELS] log10 mel power of a mono waveform (zero-padded to at least one window)."""
    x = np.asarray(x, np.float64).ravel()
    x = np.pad(x, (0, max(0, N_FFT - x.size)))
    n = 1 + (x.size - N_FFT) // HOP
    frames = np.lib.stride_tricks.sliding_window_view(x, N_FFT)[::HOP][:n] * np.hanning(N_FFT)
    power = np.abs(np.fft.rfft(frames, axis=-1)) ** 2
    return np.log10(np.maximum(power @ _mel_filters(sample_rate).T, LOG_FLOOR))


def log_mel_distance_db(ref: np.ndarray, x: np.ndarray, sample_rate: int) -> float:
    """Mean absolute log-mel difference in dB (10·|Δlog10 power|, averaged over frames and bands), counted
    over the bins where the reference has energy (within 80 dB of its peak: silence's floor is not audio)."""
    a, b = log_mel(ref, sample_rate), log_mel(x, sample_rate)
    live = a >= a.max() - 8.0
    return float(10.0 * np.mean(np.abs(a - b)[live]))


def decode_agreement(ref_codec, codec, codes: np.ndarray, n_quantizers: int) -> dict:
    """SNR, log-mel distance and max |diff| of ``codec``'s one-pass decode of ``codes`` against ``ref_codec``'s."""
    ref = ref_codec.decode(codes, n_quantizers)
    audio = codec.decode(codes, n_quantizers)
    return {"snr_db": round(snr_db(ref, audio), 2),
            "log_mel_db": round(log_mel_distance_db(ref, audio, ref_codec.sample_rate), 4),
            "max_abs_diff": float(np.abs(audio - ref).max()), "peak": float(np.abs(ref).max()),
            "frames": int(codes.shape[0]), "n_quantizers": int(n_quantizers)}


def encode_agreement(ref_codec, codec, wav: np.ndarray, sample_rate: int) -> dict:
    """Share of equal codes when both bundles encode ``wav``."""
    a, b = ref_codec.encode(wav, sample_rate), codec.encode(wav, sample_rate)
    return {"codes_equal": float(np.mean(a == b)), "codes": int(a.size)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m export.codec_agreement", description=__doc__.splitlines()[0])
    p.add_argument("--ref", required=True, help="the fp32 codec bundle")
    p.add_argument("--bundle", required=True, help="the codec bundle to compare")
    p.add_argument("--golden", nargs="*", default=[], help="golden codec .npz files (wav, enc_codes)")
    p.add_argument("--frames", type=int, default=50, help="random-code frames when no --golden")
    p.add_argument("--n-quantizers", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> None:
    from engine.audio.codec import Codec
    from engine.runtime.bundle import Bundle

    args = build_parser().parse_args(argv)
    ref, other = (Codec(Bundle(Path(b), device="cpu")) for b in (args.ref, args.bundle))
    rows = []
    for path in args.golden:
        g = np.load(path)
        row = {"clip": Path(path).name, **decode_agreement(ref, other, g["enc_codes"].T, args.n_quantizers),
               **encode_agreement(ref, other, g["wav"], ref.sample_rate)}
        rows.append(row)
    if not args.golden:
        rng = np.random.default_rng(args.seed)
        codes = rng.integers(0, ref.codebook_size, size=(args.frames, ref.num_quantizers), dtype=np.int64)
        agreement = decode_agreement(ref, other, codes, args.n_quantizers)
        rows.append({"clip": f"random codes, seed {args.seed}", **agreement})
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
