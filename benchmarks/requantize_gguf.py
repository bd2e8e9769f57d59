"""Write a GGUF file in another llama.cpp type with llama-cpp-python's quantizer (llama.cpp's
`llama-quantize`), e.g. the embedded Gemma 3 270M as IQ4_XS or Q3_K_M, to measure the formats a
downloaded file may hold.  Requantizing an already quantized file (allowed here) stacks two
roundings: use it for speed and loading checks, not for quality figures.

    python benchmarks/requantize_gguf.py SRC.gguf OUT.gguf IQ4_XS
"""

from __future__ import annotations

import argparse
import ctypes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("ftype", help="a LLAMA_FTYPE_MOSTLY_* name: IQ4_XS, Q3_K_M, Q2_K, Q4_K_M, ...")
    args = parser.parse_args()
    import llama_cpp  # scripts/setup-peers.sh builds it

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.ftype}")
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(args.source.encode(), args.out.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed ({rc})")


if __name__ == "__main__":
    main()
