#!/usr/bin/env python3
"""Writes the hostile-model corpus: a tiny valid llama GGUF and malformed variants of it.

Usage:
  make_hostile_models.py OUT_DIR          the corpus, with OUT_DIR/manifest.tsv listing
                                          "file<TAB>regex" (the regex the error must match);
                                          OUT_DIR/valid.gguf is the unmodified model
  make_hostile_models.py --seeds OUT_DIR  small fuzzing seeds (metadata and one small tensor)

Every variant changes one thing of the valid model, so a test that sees the valid model load and
each variant refused knows that the change is what was refused.
"""

import math
import os
import struct
import sys

# Metadata value types and tensor types, numbered as in the GGUF format.
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
SCALAR_FORMATS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
                  BOOL: "<B", U64: "<Q", I64: "<q", F64: "<d"}
T_F32, T_F16, T_Q4_0 = 0, 1, 2
TYPE_SIZES = {T_F32: (1, 4), T_F16: (1, 2), T_Q4_0: (32, 18)}

NAN = float("nan")
INF = float("inf")


def encode_string(text):
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def encode_value(value_type, value):
    if value_type == STR:
        return encode_string(value)
    if value_type == ARR:
        element_type, elements = value
        body = struct.pack("<IQ", element_type, len(elements))
        return body + b"".join(encode_value(element_type, e) for e in elements)
    return struct.pack(SCALAR_FORMATS[value_type], value)


def floats(values, tensor_type=T_F32):
    fmt = "<f" if tensor_type == T_F32 else "<e"
    return b"".join(struct.pack(fmt, v) for v in values)


class Model:
    """A GGUF image under construction: metadata entries, tensors, and layout overrides."""

    def __init__(self, alignment=32):
        self.metadata = []  # [key, value type, value] or raw bytes (a hand-made entry)
        self.tensors = []  # dicts: name, shape, type, data; optional raw offset / dims overrides
        self.alignment = alignment
        self.tensor_count = None  # header overrides
        self.metadata_count = None
        self.version = 3

    def set(self, key, value_type, value):
        for entry in self.metadata:
            if isinstance(entry, list) and entry[0] == key:
                entry[1], entry[2] = value_type, value
                return
        self.metadata.append([key, value_type, value])

    def remove(self, key):
        self.metadata = [e for e in self.metadata if not (isinstance(e, list) and e[0] == key)]

    def tensor(self, name):
        return next(t for t in self.tensors if t["name"] == name)

    def add_tensor(self, name, shape, tensor_type, data):
        self.tensors.append({"name": name, "shape": list(shape), "type": tensor_type,
                             "data": data})

    def image(self):
        align = self.alignment
        out = b"GGUF" + struct.pack("<I", self.version)
        tensor_count = len(self.tensors) if self.tensor_count is None else self.tensor_count
        metadata_count = len(self.metadata) if self.metadata_count is None else self.metadata_count
        out += struct.pack("<QQ", tensor_count, metadata_count)
        for entry in self.metadata:
            if isinstance(entry, bytes):
                out += entry
            else:
                key, value_type, value = entry
                out += encode_string(key) + struct.pack("<I", value_type)
                out += encode_value(value_type, value)
        self.tensor_infos_at = len(out)
        offset = 0
        placed = []
        for t in self.tensors:
            dims = t.get("dims", t["shape"])
            out += encode_string(t["name"]) + struct.pack("<I", t.get("n_dims", len(dims)))
            out += b"".join(struct.pack("<Q", d & 0xFFFFFFFFFFFFFFFF) for d in dims)
            out += struct.pack("<I", t["type"])
            out += struct.pack("<Q", t.get("offset", offset))
            placed.append(offset)
            offset += -(-len(t["data"]) // align) * align
        out += b"\0" * (-len(out) % align)
        data = bytearray(offset)
        for t, start in zip(self.tensors, placed):
            data[start:start + len(t["data"])] = t["data"]
        return out + bytes(data)


HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 16, 2, 1, 32, 1


def byte_tokens():
    """GPT-2's printable stand-ins for the 256 bytes (as the tiny test models use)."""
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or b >= 174]
    tokens, extra = [], 0
    for b in range(256):
        if b in printable:
            tokens.append(chr(b))
        else:
            tokens.append(chr(256 + extra))
            extra += 1
    return tokens


def valid_model():
    m = Model()
    a = "llama"
    m.set("general.architecture", STR, a)
    m.set("general.name", STR, "hostile-base")
    m.set(a + ".block_count", U32, LAYERS)
    m.set(a + ".embedding_length", U32, HIDDEN)
    m.set(a + ".attention.head_count", U32, HEADS)
    m.set(a + ".attention.head_count_kv", U32, KV_HEADS)
    m.set(a + ".feed_forward_length", U32, FFN)
    m.set(a + ".context_length", U32, 256)
    m.set(a + ".attention.layer_norm_rms_epsilon", F32, 1e-5)
    m.set(a + ".rope.freq_base", F32, 10000.0)
    tokens = byte_tokens() + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    m.set("tokenizer.ggml.model", STR, "gpt2")
    m.set("tokenizer.ggml.pre", STR, "smollm")
    m.set("tokenizer.ggml.tokens", ARR, (STR, tokens))
    m.set("tokenizer.ggml.token_type", ARR, (I32, [1] * 256 + [3, 3, 3]))
    m.set("tokenizer.ggml.merges", ARR, (STR, []))
    m.set("tokenizer.ggml.bos_token_id", U32, 256)
    m.set("tokenizer.ggml.eos_token_id", U32, 258)
    m.set("tokenizer.ggml.add_bos_token", BOOL, 0)
    vocab = len(tokens)
    head_dim = HIDDEN // HEADS

    def pattern(count, scale):
        # Deterministic small values; the model need only run, not make sense.
        return [scale * math.sin(0.7 * i + 0.3) for i in range(count)]

    def matrix(name, cols, rows, scale=0.25):
        m.add_tensor(name, [cols, rows], T_F32, floats(pattern(cols * rows, scale)))

    matrix("token_embd.weight", HIDDEN, vocab, 1.0)
    m.add_tensor("output_norm.weight", [HIDDEN], T_F32, floats([1.0] * HIDDEN))
    for layer in range(LAYERS):
        p = "blk.%d." % layer
        m.add_tensor(p + "attn_norm.weight", [HIDDEN], T_F32, floats([1.0] * HIDDEN))
        m.add_tensor(p + "ffn_norm.weight", [HIDDEN], T_F32, floats([1.0] * HIDDEN))
        matrix(p + "attn_q.weight", HIDDEN, HEADS * head_dim)
        matrix(p + "attn_k.weight", HIDDEN, KV_HEADS * head_dim)
        matrix(p + "attn_v.weight", HIDDEN, KV_HEADS * head_dim)
        matrix(p + "attn_output.weight", HEADS * head_dim, HIDDEN)
        matrix(p + "ffn_gate.weight", HIDDEN, FFN)
        matrix(p + "ffn_up.weight", HIDDEN, FFN)
        matrix(p + "ffn_down.weight", FFN, HIDDEN)
    return m


def poke_float(m, tensor_name, index, value, tensor_type=T_F32):
    t = m.tensor(tensor_name)
    size = 4 if tensor_type == T_F32 else 2
    data = bytearray(t["data"])
    data[index * size:(index + 1) * size] = floats([value], tensor_type)
    t["data"] = bytes(data)


def as_f16(m, tensor_name):
    t = m.tensor(tensor_name)
    values = struct.unpack("<%df" % (len(t["data"]) // 4), t["data"])
    t["type"] = T_F16
    t["data"] = floats(values, T_F16)


def variants():
    """(name, error regex, mutation of a valid model) for each hostile file."""
    a = "llama."
    cases = []

    def case(name, regex):
        def register(mutate):
            cases.append((name, regex, mutate))
            return mutate
        return register

    def set_key(name, key, value_type, value, regex):
        cases.append((name, regex, lambda m: m.set(key, value_type, value)))

    out_of_range = "outside the supported range"
    # Integer hyper-parameters: 2^31 and 2^32-1 (unsigned), negative (signed), zero, 2^63.
    for key in ["block_count", "embedding_length", "attention.head_count",
                "attention.head_count_kv", "feed_forward_length", "context_length",
                "rope.dimension_count", "attention.key_length", "attention.value_length",
                "vocab_size", "expert_count"]:
        short = key.replace("attention.", "").replace(".", "_")
        quoted = (a + key).replace(".", r"\.")
        set_key(short + "_2p31", a + key, U32, 1 << 31, quoted + ".*" + out_of_range)
        set_key(short + "_2p32m1", a + key, U32, (1 << 32) - 1, quoted + ".*" + out_of_range)
        set_key(short + "_neg_i32", a + key, I32, -1, quoted + ".*" + out_of_range)
        set_key(short + "_neg_i64", a + key, I64, -(1 << 40), quoted + ".*" + out_of_range)
        set_key(short + "_2p63", a + key, U64, 1 << 63, quoted + ".*does not fit in int64")
        if key != "expert_count":  # zero experts is a dense model
            set_key(short + "_zero", a + key, U32, 0, quoted + ".*" + out_of_range)
    set_key("experts_8", a + "expert_count", U32, 8, "mixture-of-experts.*not supported")
    set_key("kv_heads_above_heads", a + "attention.head_count_kv", U32, 3, out_of_range)
    set_key("heads_not_dividing", a + "attention.head_count", U32, 3, "not a multiple of 3 heads")
    set_key("rope_dims_odd", a + "rope.dimension_count", U32, 3, "rope dimension count 3")
    set_key("rope_dims_above_head", a + "rope.dimension_count", U32, 16, "rope dimension count 16")
    set_key("key_length_mismatch", a + "attention.key_length", U32, 4, "key_length.*differs")
    set_key("vocab_size_mismatch", a + "vocab_size", U32, 300, "vocab_size 300 differs")

    # Float hyper-parameters: NaN, infinities, negative, zero, and past float range.
    eps = a + "attention.layer_norm_rms_epsilon"
    base = a + "rope.freq_base"
    for value_name, value in [("nan", NAN), ("inf", INF), ("neginf", -INF)]:
        set_key("eps_" + value_name, eps, F32, value, "layer_norm_rms_epsilon.*not a finite")
        set_key("freq_base_" + value_name, base, F32, value, "freq_base.*not a finite")
        set_key("attn_scale_" + value_name, a + "attention.scale", F32, value,
                r"attention\.scale.*not a finite")
        set_key("logit_scale_" + value_name, a + "logit_scale", F64, value,
                r"logit_scale.*not a finite")
    set_key("eps_negative", eps, F32, -1e-5, "layer_norm_rms_epsilon.*" + out_of_range)
    set_key("eps_zero", eps, F32, 0.0, "layer_norm_rms_epsilon.*" + out_of_range)
    set_key("eps_huge", eps, F32, 1e30, "layer_norm_rms_epsilon.*" + out_of_range)
    set_key("freq_base_negative", base, F32, -10000.0, "freq_base.*" + out_of_range)
    set_key("freq_base_half", base, F32, 0.5, "freq_base.*" + out_of_range)
    set_key("freq_base_f64_huge", base, F64, 1e300, "freq_base.*" + out_of_range)
    cases.append(("float_array_nan", "scaling_factors.*element \\[1\\].*not a finite",
                  lambda m: m.set(a + "rope.scaling_factors", ARR, (F32, [1.0, NAN]))))
    for factor_name, factor in [("nan", NAN), ("half", 0.5), ("negative", -2.0), ("huge", 1e9)]:
        @case("rope_linear_factor_" + factor_name, "scaling.factor|not a finite")
        def _(m, factor=factor):
            m.set(a + "rope.scaling.type", STR, "linear")
            m.set(a + "rope.scaling.factor", F32, factor)
    for freq_name, freq in [("nan", NAN), ("zero", 0.0), ("negative", -1.0), ("inf", INF)]:
        @case("rope_freqs_" + freq_name, "rope_freqs.*element \\[2\\]")
        def _(m, freq=freq):
            m.add_tensor("rope_freqs.weight", [4], T_F32, floats([1.0, 1.0, freq, 1.0]))
    cases.append(("rope_freqs_wrong_size", "rope_freqs.*must be F32 \\[4\\]",
                  lambda m: m.add_tensor("rope_freqs.weight", [3], T_F32, floats([1.0] * 3))))

    # Keys of the wrong type.
    set_key("block_count_string", a + "block_count", STR, "1", "block_count.*expected an integer")
    set_key("eps_string", eps, STR, "1e-5", "epsilon.*expected a number")
    set_key("arch_uint", "general.architecture", U32, 7, "general.architecture.*expected a string")
    set_key("name_uint", "general.name", U32, 7, "general.name.*expected a string")
    set_key("rope_scaling_uint", a + "rope.scaling.type", U32, 1,
            "rope.scaling.type.*expected a string")
    set_key("vocab_size_float", a + "vocab_size", F32, 259.0, "vocab_size.*expected an integer")
    set_key("head_count_kv_array", a + "attention.head_count_kv", ARR, (U32, [1]),
            "head_count_kv.*expected an integer")
    set_key("tokens_ints", "tokenizer.ggml.tokens", ARR, (I32, [1, 2, 3]),
            "tokenizer.ggml.tokens.*expected an array of string")
    set_key("merges_uint", "tokenizer.ggml.merges", U32, 0,
            "tokenizer.ggml.merges.*expected an array of string")
    cases.append(("missing_eps", "layer_norm_rms_epsilon.*not found", lambda m: m.remove(eps)))

    # Vocabulary arrays that disagree with the embedding.
    cases.append(("tokens_short", "tokens|vocab|embedding",
                  lambda m: m.set("tokenizer.ggml.tokens", ARR, (STR, byte_tokens()))))
    cases.append(("tokens_empty", "token",
                  lambda m: m.set("tokenizer.ggml.tokens", ARR, (STR, []))))

    # Non-finite weights, in vectors read at load and in matrices used as stored.
    weights = "non-finite weight"
    for tensor_name, index, value in [("blk.0.attn_norm.weight", 3, NAN),
                                      ("output_norm.weight", 0, INF),
                                      ("blk.0.ffn_norm.weight", 15, -INF),
                                      ("blk.0.ffn_down.weight", 100, NAN),
                                      ("blk.0.attn_q.weight", 0, INF),
                                      ("token_embd.weight", 16 * 258 + 5, NAN)]:
        short = tensor_name.replace("blk.0.", "").replace(".weight", "")
        cases.append(("weight_%s_%s" % (short, "nan" if value != value else "inf"),
                      tensor_name.replace(".", r"\.") + ".*" + weights,
                      lambda m, n=tensor_name, i=index, v=value: poke_float(m, n, i, v)))

    @case("weight_f16_inf", r"blk\.0\.ffn_up\.weight.*" + weights)
    def _(m):
        as_f16(m, "blk.0.ffn_up.weight")
        poke_float(m, "blk.0.ffn_up.weight", 7, INF, T_F16)

    @case("weight_untied_output_nan", r"output\.weight.*" + weights)
    def _(m):
        m.add_tensor("output.weight", [HIDDEN, 259], T_F32,
                     floats([0.0] * 5 + [NAN] + [0.0] * (HIDDEN * 259 - 6)))

    # The container: counts, dimensions, offsets, alignment, types, strings and truncation.
    @case("tensor_count_2p31", "claims 2147483648 tensors")
    def _(m):
        m.tensor_count = 1 << 31

    @case("tensor_count_2p64m1", "claims 18446744073709551615 tensors")
    def _(m):
        m.tensor_count = (1 << 64) - 1

    @case("metadata_count_2p32m1", "claims 4294967295 metadata entries")
    def _(m):
        m.metadata_count = (1 << 32) - 1

    # The last entry (add_bos_token) is then read as the first tensor info.
    @case("metadata_count_short", "tensor 'tokenizer.ggml.add_bos_token'")
    def _(m):
        m.metadata_count = len(m.metadata) - 1

    for align_name, value_type, value, regex in [
            ("3", U32, 3, "power of two"), ("0", U32, 0, "power of two"),
            ("neg", I32, -32, "power of two"), ("2p63", U64, 1 << 63, "power of two"),
            ("2p31", U32, 1 << 31, "past the end|alignment"),
            ("string", STR, "32", "general.alignment.*must be an integer")]:
        set_key("alignment_" + align_name, "general.alignment", value_type, value, regex)

    def tensor_field(name, field, value, regex, tensor_name="blk.0.attn_v.weight"):
        cases.append((name, regex, lambda m: m.tensor(tensor_name).__setitem__(field, value)))

    tensor_field("dims_5", "n_dims", 5, "5 dimensions")
    tensor_field("dims_2p32m1", "n_dims", (1 << 32) - 1, "4294967295 dimensions")
    tensor_field("dims_0", "n_dims", 0, "0 dimensions")
    tensor_field("dim_zero", "dims", [HIDDEN, 0], "dimension 1 is 0")
    tensor_field("dim_2p63", "dims", [HIDDEN, 1 << 63], "dimension 1 is 9223372036854775808")
    tensor_field("dim_product_overflow", "dims", [1 << 32, 1 << 32], "element count overflows")
    tensor_field("dim_2p31", "dims", [HIDDEN, 1 << 31], "past the end")
    tensor_field("shape_wrong", "dims", [8, 16], r"attn_v\.weight.*shape \[8, 16\]")
    tensor_field("offset_misaligned", "offset", 1, "not a multiple of the alignment")
    tensor_field("offset_past_end", "offset", (1 << 64) - 32, "past the end")
    tensor_field("offset_2p32", "offset", 1 << 32, "past the end")
    tensor_field("type_unknown", "type", 99, "99")
    tensor_field("type_q4_0_row_16", "type", T_Q4_0, "not a multiple of the Q4_0 block size")
    tensor_field("name_empty", "name", "", "empty name")
    tensor_field("type_size_overflow", "dims", [1 << 62, 2], "overflow|past the end")

    @case("tensors_overlap", "overlaps")
    def _(m):
        m.tensor("blk.0.attn_k.weight")["offset"] = 0

    @case("tensor_duplicate", "appears twice")
    def _(m):
        m.tensor("blk.0.attn_k.weight")["name"] = "blk.0.attn_q.weight"

    cases.append(("tensor_missing", r"blk\.0\.ffn_down\.weight.*missing",
                  lambda m: m.tensors.remove(m.tensor("blk.0.ffn_down.weight"))))
    cases.append(("key_duplicate", "appears twice",
                  lambda m: m.metadata.append([a + "block_count", U32, 1])))
    cases.append(("key_string_huge", "runs past the end",
                  lambda m: m.metadata.insert(0, struct.pack("<Q", (1 << 64) - 1) + b"key")))
    cases.append(("key_empty", "empty key",
                  lambda m: m.metadata.insert(0, encode_string("") + struct.pack("<IB", U8, 1))))
    cases.append(("value_type_unknown", "unknown value type 13",
                  lambda m: m.metadata.insert(0, encode_string("x") + struct.pack("<IB", 13, 1))))
    cases.append(("bool_two", "bool value is 2", lambda m: m.set("x.flag", BOOL, 2)))
    cases.append(("array_count_huge", "remain in the file",
                  lambda m: m.metadata.insert(0, encode_string("x") +
                                              struct.pack("<IIQ", ARR, U32, 1 << 62))))
    cases.append(("array_type_unknown", "unknown array element type",
                  lambda m: m.metadata.insert(0, encode_string("x") +
                                              struct.pack("<IIQ", ARR, 77, 1))))

    @case("array_nested_deep", "nested more than")
    def _(m):
        value = (U8, [1])
        for _ in range(12):
            value = (ARR, [value])
        m.set("x.deep", ARR, value)

    @case("version_1", "version 1 is not supported")
    def _(m):
        m.version = 1

    @case("big_endian", "big-endian")
    def _(m):
        m.version = 3 << 24

    return cases


def truncations(model):
    """(name, error regex, bytes) for the valid image cut at several places."""
    image = model.image()
    infos = model.tensor_infos_at
    return [("truncated_magic", "too small", image[:6]),
            ("truncated_header", "metadata entry count: needs 8 bytes", image[:20]),
            ("truncated_metadata", "remain in the file|past the end", image[:300]),
            ("truncated_tensor_infos", "claims %d tensors but only 60 bytes" % len(model.tensors),
             image[:infos + 60]),
            ("truncated_data", "past the end", image[:len(image) - 100])]


def write_corpus(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    rows = []

    def write(name, regex, data):
        with open(os.path.join(out_dir, name + ".gguf"), "wb") as f:
            f.write(data)
        rows.append("%s.gguf\t%s" % (name, regex))

    valid = valid_model().image()
    with open(os.path.join(out_dir, "valid.gguf"), "wb") as f:
        f.write(valid)
    for name, regex, mutate in variants():
        m = valid_model()
        mutate(m)
        write(name, regex, m.image())
    for name, regex, data in truncations(valid_model()):
        write(name, regex, data)
    with open(os.path.join(out_dir, "manifest.tsv"), "w") as f:
        f.write("\n".join(rows) + "\n")


def write_seeds(out_dir):
    """Config-sized seeds: the model's metadata with a 4-wide embedding, valid and broken."""
    os.makedirs(out_dir, exist_ok=True)

    def seed_model():
        m = Model()
        for key, value_type, value in [
                ("general.architecture", STR, "llama"), ("llama.block_count", U32, 1),
                ("llama.embedding_length", U32, 4), ("llama.attention.head_count", U32, 2),
                ("llama.attention.head_count_kv", U32, 1), ("llama.feed_forward_length", U32, 8),
                ("llama.context_length", U32, 64),
                ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
                ("llama.rope.freq_base", F32, 10000.0), ("llama.rope.dimension_count", U32, 2)]:
            m.set(key, value_type, value)
        m.add_tensor("token_embd.weight", [4, 2], T_F32, floats([0.5] * 8))
        m.add_tensor("rope_freqs.weight", [1], T_F32, floats([1.0]))
        m.add_tensor("output_norm.weight", [4], T_F16, floats([1.0] * 4, T_F16))
        return m

    seeds = {"config_valid": lambda m: None,
             "config_block_count_2p31": lambda m: m.set("llama.block_count", U32, 1 << 31),
             "config_eps_nan": lambda m: m.set("llama.attention.layer_norm_rms_epsilon", F32,
                                               NAN),
             "config_freq_base_negative": lambda m: m.set("llama.rope.freq_base", F64, -1.0),
             "config_norm_inf": lambda m: poke_float(m, "output_norm.weight", 1, INF, T_F16)}
    for name, mutate in seeds.items():
        m = seed_model()
        mutate(m)
        with open(os.path.join(out_dir, name + ".gguf"), "wb") as f:
            f.write(m.image())


def main(argv):
    if len(argv) == 3 and argv[1] == "--seeds":
        write_seeds(argv[2])
    elif len(argv) == 2 and not argv[1].startswith("-"):
        write_corpus(argv[1])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
