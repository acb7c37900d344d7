"""ISA compile specs: what pytest_cdna2/isa.py compiles ahead of time, one entry per kernel variant at V4-Flash
tiles: ISA_SPECS for gfx90a and sm_90, ISA_SPECS_SM90 for sm_90 only."""

from __future__ import annotations

from .attention import (
    attention_combine_kernel,
    attention_kernel,
    compress_finish_kernel,
    compress_pool_kernel,
    index_scores_kernel,
)
from .base import PDL_AVAILABLE
from .dense import dense_gemv_kernel, dense_mma_kernel
from .fp8 import fp8_stream_kernel, matmul_kernel
from .mhc import hc_mix_dot_kernel, hc_mix_partial_kernel, hc_post_kernel, hc_pre_kernel
from .mma import (
    fp8_mma_kernel,
    moe_mma_down_kernel,
    moe_mma_gate_up_kernel,
    moe_mma_one_kernel,
    moe_mma_one_sum_kernel,
)
from .moe import moe_down_kernel, moe_gate_up_kernel, moe_pair_rows_kernel, moe_sum_kernel, swiglu_kernel
from .norm_rope import rms_norm_kernel, rope_cos_sin_kernel, rope_kernel
from .topk import route_kernel, topk_kernel, topk_sort_kernel

# ISA compile specs (pytest_cdna2/isa.py compiles each ahead of time for gfx90a and sm_90). One entry per
# kernel at representative V4-Flash tiles; `matmul` says whether the kernel must contain MFMA (v_mfma).


def _sig(names: str, types: str, num_stages: int | None = None, **const: object) -> tuple[dict[str, str],
                                                                                        dict[str, object]]:
    """Signature dict from parallel space-separated lists; constexpr names given as keywords. `num_stages`: the
    software-pipelining depth the engine launches the kernel with (a compile option, not a constexpr: the audit
    takes it out of the constexprs), so the LDS the audit reads is the launch's."""
    sig = dict(zip(names.split(), types.split(), strict=True))
    sig.update({k: "constexpr" for k in const})
    return sig, dict(const) if num_stages is None else dict(const, num_stages=num_stages)


_FP8_ARGS = ("x_ptr w_ptr s_ptr y_ptr M R K stride_xm stride_xg stride_wn stride_sn stride_ym stride_yg",
             "*bf16 *u8 *u8 *bf16 i32 i32 i32 i32 i32 i32 i32 i32 i32")
_FP8_STREAM_ARGS = (_FP8_ARGS[0] + " K_CHUNK part_ptr lock_ptr stride_ps", _FP8_ARGS[1] + " i32 *fp32 *i32 i32")
_FP8_WORDS_ARGS = (_FP8_STREAM_ARGS[0], _FP8_STREAM_ARGS[1].replace("*u8", "*i32", 1))  # PREFETCH: W as uint32 words
_MOE_UP = ("x_ptr w1_ptr s1_ptr w3_ptr s3_ptr h_ptr pair_tok_ptr blk_e_ptr blk_lo_ptr blk_hi_ptr I D limit "
           "stride_xt stride_we stride_wn stride_se stride_sn stride_hp",
           "*bf16 *u8 *u8 *u8 *u8 *fp32 *i32 *i32 *i32 *i32 i32 i32 fp32 i32 i32 i32 i32 i32 i32")
_MOE_DOWN = ("h_ptr w2_ptr s2_ptr c_ptr pair_id_ptr pair_w_ptr blk_e_ptr blk_lo_ptr blk_hi_ptr D I "
             "stride_hp stride_we stride_wn stride_se stride_sn stride_cp out_ptr add_ptr lock_ptr",
             "*fp32 *u8 *u8 *fp32 *i32 *fp32 *i32 *i32 *i32 i32 i32 i32 i32 i32 i32 i32 i32 *bf16 *bf16 *i32")
_ATTN = ("q_ptr kv_ptr sink_ptr mask_ptr o_ptr S H L D scale stride_qb stride_qs stride_qh stride_kb "
         "stride_kl stride_mb stride_ms stride_ob stride_os stride_oh",
         "*bf16 *bf16 *fp32 *u8 *bf16 i32 i32 i32 i32 fp32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32")
_IDX = ("q_ptr k_ptr w_ptr o_ptr S H T D scale stride_qb stride_qs stride_qh stride_kb stride_kt stride_wb "
        "stride_ws stride_ob stride_os",
        "*bf16 *bf16 *bf16 *fp32 i32 i32 i32 i32 fp32 i32 i32 i32 i32 i32 i32 i32 i32 i32")

# (name, kernel, (signature, constexprs), num_warps, matmul)
ISA_SPECS: list[tuple[str, object, tuple[dict[str, str], dict[str, object]], int, bool]] = [
    ("fp8_stream", fp8_stream_kernel,  # the default tile (FP8_STREAM)
     _sig(*_FP8_STREAM_ARGS, BLOCK_N=32, BLOCK_K=256, HW=False, UNIFORM=True, UNROLL=1, SPLIT=1, LOCAL=16), 4, False),
    ("fp8_stream_unroll", fp8_stream_kernel,  # two tiles a step, no in-thread sums
     _sig(*_FP8_STREAM_ARGS, BLOCK_N=32, BLOCK_K=256, HW=False, UNIFORM=True, UNROLL=2, SPLIT=1), 4, False),
    ("fp8_stream_long", fp8_stream_kernel,  # FP8_STREAM_LONG: 8 rows x 1 KB a step (K >= 2048), split K
     _sig(*_FP8_STREAM_ARGS, BLOCK_N=8, BLOCK_K=1024, HW=False, UNIFORM=True, UNROLL=1, SPLIT=2, SPLITP=2, LOCAL=16),
     4, False),
    ("fp8_stream_xnorm", fp8_stream_kernel,  # wq_b's form: q_norm applied as x is read (the row's RMS first)
     _sig(_FP8_STREAM_ARGS[0] + " nw_ptr x_eps", _FP8_STREAM_ARGS[1] + " *bf16 fp32", BLOCK_N=32, BLOCK_K=256,
          HW=False, UNIFORM=True, UNROLL=1, SPLIT=1, X_NORM=True, XP=1024, LOCAL=16), 4, False),
    ("fp8_stream_glu", fp8_stream_kernel,  # the shared expert's w2: swiglu(gate, up) applied as x is read
     _sig(_FP8_STREAM_ARGS[0] + " glu_limit", _FP8_STREAM_ARGS[1] + " fp32", BLOCK_N=8, BLOCK_K=1024,
          HW=False, UNIFORM=True, UNROLL=1, SPLIT=2, SPLITP=2, X_GLU=2, LOCAL=16), 4, False),
    ("fp8_stream_rows", fp8_stream_kernel,  # gfx90a's E4M3 bit decode, per-row scales, split K
     _sig(*_FP8_STREAM_ARGS, BLOCK_N=32, BLOCK_K=256, HW=False, UNIFORM=False, UNROLL=1, SPLIT=4, SPLITP=4, LOCAL=16),
     4, False),
    ("fp8_matmul", matmul_kernel,  # FP8_DOT as gfx90a runs a long prefill (64 rows a program)
     _sig(*_FP8_ARGS, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, IEEE=False, num_stages=3), 8, True),
    ("fp8_matmul_scaled_steps", matmul_kernel,  # fp32 x (and fp16): each step's partial scaled, no fold
     _sig(_FP8_ARGS[0], _FP8_ARGS[1].replace("*bf16 *u8 *u8 *bf16", "*fp32 *u8 *u8 *fp32"), BLOCK_M=64, BLOCK_N=128,
          BLOCK_K=64, IEEE=True, FOLD=False, num_stages=3), 8, True),
    ("dense_matmul", matmul_kernel,  # the compressors' bf16 W at a long prefill
     _sig(_FP8_ARGS[0], _FP8_ARGS[1].replace("*u8 *u8", "*bf16 *bf16"), BLOCK_M=64, BLOCK_N=128, BLOCK_K=64,
          IEEE=False, SCALED=False, num_stages=3), 8, True),
    ("dense_matmul_parts", matmul_kernel,  # the head at a prefill with every position's logits: fp32 x, bf16 W
     _sig(_FP8_ARGS[0], "*fp32 *bf16 *bf16 *fp32 " + _FP8_ARGS[1].split(" ", 4)[4], BLOCK_M=64, BLOCK_N=128,
          BLOCK_K=64, IEEE=False, SCALED=False, PARTS=3, num_stages=3), 8, True),
    ("moe_gate_up_dot", moe_gate_up_kernel,
     _sig(*_MOE_UP, HAS_LIMIT=True, BLOCK_M=16, BLOCK_N=32, GROUPS=4, DOT=1, num_stages=3), 4, True),
    ("moe_down_dot", moe_down_kernel,
     _sig(*_MOE_DOWN, BLOCK_M=16, BLOCK_N=64, GROUPS=4, DOT=1, num_stages=3), 4, True),
    # a prefill's MoE on ROCm: tokens grouped by expert into 32- and 64-row blocks (MOE_DOT with MOE_DOT_ROCM: no
    # swap, 4 warps, at most 64 rows; 32 rows from about 340 tokens a batch, 64 from about 1366)
    ("moe_gate_up_dot_rocm_32", moe_gate_up_kernel,
     _sig(*_MOE_UP, HAS_LIMIT=True, BLOCK_M=32, BLOCK_N=64, GROUPS=2, DOT=1, SWAP=False, num_stages=3), 4, True),
    ("moe_gate_up_dot_rocm_64", moe_gate_up_kernel,
     _sig(*_MOE_UP, HAS_LIMIT=True, BLOCK_M=64, BLOCK_N=64, GROUPS=2, DOT=1, SWAP=False, num_stages=3), 4, True),
    ("moe_down_dot_rocm_32", moe_down_kernel,
     _sig(*_MOE_DOWN, BLOCK_M=32, BLOCK_N=128, GROUPS=2, DOT=1, SWAP=False, num_stages=3), 4, True),
    ("moe_down_dot_rocm_64", moe_down_kernel,
     _sig(*_MOE_DOWN, BLOCK_M=64, BLOCK_N=128, GROUPS=2, DOT=1, SWAP=False, num_stages=3), 4, True),
    ("moe_gate_up_stream", moe_gate_up_kernel,  # the default gate/up tile (MOE_STREAM) as gfx90a runs it
     _sig(_MOE_UP[0], _MOE_UP[1].replace("*u8 *u8 *u8 *u8", "*i32 *u8 *i32 *u8"),
          HAS_LIMIT=True, BLOCK_M=1, BLOCK_N=4, GROUPS=32, STREAM=True), 2, False),
    ("moe_down_stream", moe_down_kernel,  # one token: the k pair rows summed by the last pair (+ shared)
     _sig(_MOE_DOWN[0], _MOE_DOWN[1].replace("*u8 *u8", "*i32 *u8"), BLOCK_M=1, BLOCK_N=16, GROUPS=8,
          STREAM=True, SUM=True, HAS_ADD=True, SPLITP=8), 4, False),
    ("fp8_stream_prefetch", fp8_stream_kernel,  # the default tile (FP8_STREAM), register double buffering
     _sig(*_FP8_WORDS_ARGS, BLOCK_N=32, BLOCK_K=256, HW=False, UNIFORM=True, UNROLL=1, SPLIT=1, PREFETCH=True,
          LOCAL=16), 4, False),
    ("moe_gate_up_stream_prefetch", moe_gate_up_kernel,
     _sig(_MOE_UP[0], _MOE_UP[1].replace("*u8 *u8 *u8 *u8", "*i32 *u8 *i32 *u8"),
          HAS_LIMIT=True, BLOCK_M=1, BLOCK_N=16, GROUPS=8, STREAM=True, PREFETCH=True), 4, False),
    ("moe_down_stream_prefetch", moe_down_kernel,
     _sig(_MOE_DOWN[0], _MOE_DOWN[1].replace("*u8 *u8", "*i32 *u8"), BLOCK_M=1, BLOCK_N=16, GROUPS=8,
          STREAM=True, SUM=True, HAS_ADD=True, PREFETCH=True, SPLITP=8), 4, False),
    ("moe_pair_rows", moe_pair_rows_kernel,  # 64 tokens x 6 pairs two to a row (the tensor-core MoE's table)
     _sig("e_ptr rows_ptr P", "*i64 *i32 i32", PP=512, CHUNK=32), 4, False),
    ("moe_sum", moe_sum_kernel, _sig("c_ptr out_ptr add_ptr D", "*fp32 *bf16 *bf16 i32", TOPK=6, BLOCK_D=1024,
                                     HAS_ADD=True), 4, False),
    ("rms_norm", rms_norm_kernel,
     _sig("x_ptr w_ptr y_ptr D eps stride_x stride_y", "*bf16 *bf16 *bf16 i32 fp32 i32 i32",
          HAS_W=True, BLOCK_D=4096), 4, False),
    ("rope", rope_kernel,
     _sig("x_ptr cos_ptr sin_ptr y_ptr w_ptr H D HALF SIGN EPS", "*bf16 *fp64 *fp64 *bf16 *bf16 i32 i32 i32 fp32 fp32",
          BLOCK_H=64, BLOCK_D=512, BLOCK_R=32, NORM=False, HAS_W=False), 4, False),
    ("norm_rope", rope_kernel,  # decode: one head per program, RMSNorm (weighted, as kv_norm) then RoPE
     _sig("x_ptr cos_ptr sin_ptr y_ptr w_ptr H D HALF SIGN EPS", "*bf16 *fp64 *fp64 *bf16 *bf16 i32 i32 i32 fp32 fp32",
          BLOCK_H=1, BLOCK_D=512, BLOCK_R=32, NORM=True, HAS_W=True), 4, False),
    ("norm_rope_ring", rope_kernel,  # decode's K=V row, also written into the window ring
     _sig("x_ptr cos_ptr sin_ptr y_ptr w_ptr H D HALF SIGN EPS ring_ptr ok_ptr pos_ptr W stride_rb stride_rs "
          "stride_ob", "*bf16 *fp64 *fp64 *bf16 *bf16 i32 i32 i32 fp32 fp32 *bf16 *u8 *i64 i32 i32 i32 i32",
          BLOCK_H=1, BLOCK_D=512, BLOCK_R=32, NORM=True, HAS_W=True, RING=True), 4, False),
    ("rope_cos_sin", rope_cos_sin_kernel,
     _sig("pos_ptr inv_ptr cos_ptr sin_ptr N HALF ALIGN", "*i64 *fp64 *fp64 *fp64 i32 i32 i32", BLOCK_N=16,
          BLOCK_R=32), 4, False),
    ("attention", attention_kernel,  # the model's form: the output's inverse RoPE in the epilogue (ROPE)
     _sig(_ATTN[0] + " cos_ptr sin_ptr HALF", _ATTN[1] + " *fp64 *fp64 i32", BLOCK_H=16, BLOCK_L=16,
          BLOCK_D=512, IEEE=False, SPLIT=False, CHUNK=0, part_ptr=None, ml_ptr=None, ROPE=True, SCAN=512), 8, True),
    ("attention_split", attention_kernel,
     _sig(_ATTN[0] + " CHUNK part_ptr ml_ptr", _ATTN[1] + " i32 *fp32 *fp32",
          BLOCK_H=16, BLOCK_L=16, BLOCK_D=512, IEEE=False, SPLIT=True, GATHER=False), 8, True),
    ("attention_split_gather", attention_kernel,  # a decode split over a long context: only visible keys read
     _sig(_ATTN[0] + " CHUNK part_ptr ml_ptr", _ATTN[1] + " i32 *fp32 *fp32",
          BLOCK_H=16, BLOCK_L=16, BLOCK_D=512, IEEE=False, SPLIT=True), 8, True),
    ("attention_combine", attention_combine_kernel,
     _sig("part_ptr ml_ptr sink_ptr o_ptr S H D n_split stride_ob stride_os stride_oh cos_ptr sin_ptr HALF",
          "*fp32 *fp32 *fp32 *bf16 i32 i32 i32 i32 i32 i32 i32 *fp64 *fp64 i32", BLOCK_H=16, BLOCK_D=32, BLOCK_S=16,
          ROPE=True), 4, False),
    ("index_scores", index_scores_kernel,
     _sig(*_IDX, BLOCK_H=64, BLOCK_T=32, BLOCK_D=128, IEEE=False), 4, True),
    ("index_scores_visible", index_scores_kernel,  # hidden entries -inf in the same launch
     _sig(_IDX[0] + " vis_ptr stride_vb stride_vs stride_vt", _IDX[1] + " *u8 i32 i32 i32", BLOCK_H=64, BLOCK_T=32,
          BLOCK_D=128, IEEE=False, VISIBLE=True), 4, True),
    ("dense_gemv", dense_gemv_kernel,
     _sig("x_ptr w_ptr y_ptr part_ptr lock_ptr M N K K_CHUNK n_split stride_xm stride_wn stride_ym stride_ps",
          "*fp32 *bf16 *fp32 *fp32 *i32 i32 i32 i32 i32 i32 i32 i32 i32 i32", BLOCK_M=1, BLOCK_N=8, BLOCK_K=512,
          SPLITP=0), 2, False),
    ("dense_gemv_narrow", dense_gemv_kernel,  # narrow W (router, compressors): all of K in one load
     _sig("x_ptr w_ptr y_ptr part_ptr lock_ptr M N K K_CHUNK n_split stride_xm stride_wn stride_ym stride_ps",
          "*fp32 *bf16 *fp32 *fp32 *i32 i32 i32 i32 i32 i32 i32 i32 i32 i32", BLOCK_M=1, BLOCK_N=2, BLOCK_K=4096,
          SPLITP=0), 4, False),
    ("dense_gemv_split", dense_gemv_kernel,  # the in-kernel split-K sum (integer atomics, fixed order)
     _sig("x_ptr w_ptr y_ptr part_ptr lock_ptr M N K K_CHUNK n_split stride_xm stride_wn stride_ym stride_ps",
          "*fp32 *bf16 *fp32 *fp32 *i32 i32 i32 i32 i32 i32 i32 i32 i32 i32", BLOCK_M=1, BLOCK_N=8, BLOCK_K=512,
          SPLITP=16), 2, False),
    ("dense_mma", dense_mma_kernel,  # the head at 2-16 fp32 rows: 4 bf16 parts a row on MFMA / mma
     _sig("xp_ptr w_ptr y_ptr M N K stride_xc stride_wn stride_ym", "*bf16 *bf16 *fp32 i32 i32 i32 i32 i32 i32",
          PARTS=4, BLOCK_N=128, BLOCK_C=32, BLOCK_K=64, IEEE=False, num_stages=4), 4, True),
    ("compress_pool", compress_pool_kernel,
     _sig("kv_ptr gate_ptr rkv_ptr rg_ptr ape_ptr ent_ptr pos_ptr C D stride_kb stride_rb stride_rs stride_eb "
          "stride_es", "*fp32 *fp32 *fp32 *fp32 *fp32 *bf16 *i64 i32 i32 i32 i32 i32 i32 i32",
          R=128, RING=128, NSLOT=128, BLOCK_C=64), 4, False),
    ("compress_pool_csa", compress_pool_kernel,
     _sig("kv_ptr gate_ptr rkv_ptr rg_ptr ape_ptr ent_ptr pos_ptr C D stride_kb stride_rb stride_rs stride_eb "
          "stride_es", "*fp32 *fp32 *fp32 *fp32 *fp32 *bf16 *i64 i32 i32 i32 i32 i32 i32 i32",
          R=4, RING=8, NSLOT=8, BLOCK_C=64), 4, False),
    ("compress_finish", compress_finish_kernel,
     _sig("ent_ptr valid_ptr norm_ptr cos_ptr sin_ptr pos_ptr D HALF EPS stride_eb stride_es stride_vb",
          "*bf16 *u8 *bf16 *fp64 *fp64 *i64 i32 i32 fp32 i32 i32 i32", R=4, BLOCK_D=512, BLOCK_R=32), 4, False),
    ("topk", topk_kernel, _sig("s_ptr idx_ptr margin_ptr W stride_s", "*fp32 *i64 *fp32 i32 i32", K=6, HAS_NEXT=True,
                               BLOCK_W=256), 1, False),
    ("topk_sort", topk_sort_kernel,
     _sig("s_ptr idx_ptr margin_ptr mask_ptr W K stride_s stride_m", "*fp32 *i64 *fp32 *i8 i32 i32 i32 i32",
          IDX=True, MASK=True, BLOCK_W=4096), 8, False),
    ("route", route_kernel,
     _sig("l_ptr bias_ptr fixed_ptr idx_ptr w_ptr margin_ptr W stride_l scale",
          "*fp32 *fp32 *fp32 *i64 *fp32 *fp32 i32 i32 fp32", K=6, KP=8, SCORING=0, HAS_BIAS=True, FIXED=False,
          HAS_NEXT=True, BLOCK_W=256), 1, False),
    ("route_hash", route_kernel,  # hash layers: the experts come from the token-id table
     _sig("l_ptr bias_ptr fixed_ptr idx_ptr w_ptr margin_ptr W stride_l scale",
          "*fp32 *fp32 *i32 *i64 *fp32 *fp32 i32 i32 fp32", K=6, KP=8, SCORING=0, HAS_BIAS=False, FIXED=True,
          HAS_NEXT=True, BLOCK_W=256), 1, False),
    ("swiglu", swiglu_kernel,
     _sig("g_ptr u_ptr y_ptr I limit stride_g stride_u stride_y", "*bf16 *bf16 *bf16 i32 fp32 i32 i32 i32",
          HAS_LIMIT=True, BLOCK=1024), 4, False),
    ("hc_mix_partial", hc_mix_partial_kernel,
     _sig("h_ptr fn_ptr part_ptr N D CHUNK MIX stride_h stride_fn stride_p stride_hn",
          "*bf16 *fp32 *fp64 i32 i32 i32 i32 i32 i32 i32 i32", PW=40, NP=4, MIXP=32, BLOCK_D=32), 4, False),
    ("hc_pre", hc_pre_kernel,  # the collapse with the block's RMSNorm (op hc_pre, and hc_post_pre's second launch)
     _sig("part_ptr h_ptr base_ptr scale_ptr post_ptr comb_ptr x_ptr N D SPLIT ITERS NORM_EPS HC_EPS stride_p "
          "stride_h stride_x stride_hn nw_ptr xn_ptr BLOCK_EPS",
          "*fp64 *bf16 *fp32 *fp32 *fp32 *fp32 *bf16 i32 i32 i32 i32 fp32 fp32 i32 i32 i32 i32 *bf16 *bf16 fp32",
          PW=40, NP=4, SPLITP=128, BLOCK_D=256, NORM=True), 1, False),
    ("hc_weights", hc_pre_kernel,  # post and comb (Sinkhorn) from the mix sums, beside the block (op hc_weights)
     _sig("part_ptr h_ptr base_ptr scale_ptr post_ptr comb_ptr x_ptr N D SPLIT ITERS NORM_EPS HC_EPS stride_p "
          "stride_h stride_x stride_hn", "*fp64 *fp64 *fp32 *fp32 *fp32 *fp32 *fp32 i32 i32 i32 i32 fp32 fp32 i32 i32 "
          "i32 i32", PW=40, NP=4, SPLITP=128, BLOCK_D=1, WEIGHTS=True), 1, False),
    ("hc_head", hc_pre_kernel,  # the model head's collapse and final norm: pre weights only, fp32 out
     _sig("part_ptr h_ptr base_ptr scale_ptr post_ptr comb_ptr x_ptr N D SPLIT ITERS NORM_EPS HC_EPS stride_p "
          "stride_h stride_x stride_hn nw_ptr xn_ptr BLOCK_EPS",
          "*fp64 *bf16 *fp32 *fp32 *fp32 *fp32 *fp32 i32 i32 i32 i32 fp32 fp32 i32 i32 i32 i32 *bf16 *fp32 fp32",
          PW=20, NP=4, SPLITP=128, BLOCK_D=256, NORM=True), 1, False),
    ("hc_post", hc_post_kernel,
     _sig("out_ptr h_ptr post_ptr comb_ptr y_ptr fn_ptr part_ptr N D MIX stride_o stride_h stride_y stride_fn "
          "stride_p stride_hn", "*bf16 *bf16 *fp32 *fp32 *bf16 *fp32 *fp32 i32 i32 i32 i32 i32 i32 i32 i32 i32", NP=4,
          BLOCK_D=256), 4, False),
    ("hc_post_pre", hc_post_kernel,  # with the next hc_pre's mix partials (op hc_post_pre)
     _sig("out_ptr h_ptr post_ptr comb_ptr y_ptr fn_ptr part_ptr N D MIX stride_o stride_h stride_y stride_fn "
          "stride_p stride_hn", "*bf16 *bf16 *fp32 *fp32 *bf16 *fp32 *fp64 i32 i32 i32 i32 i32 i32 i32 i32 i32", NP=4,
          BLOCK_D=32, MIXP=32, PW=40, MIX_NEXT=True), 4, False),
    ("hc_post_gram", hc_post_kernel,  # a prefill's: the Gram matrix only, hc_mix_dot the dots (HC_MIX_DOT)
     _sig("out_ptr h_ptr post_ptr comb_ptr y_ptr fn_ptr part_ptr N D MIX stride_o stride_h stride_y stride_fn "
          "stride_p stride_hn", "*bf16 *bf16 *fp32 *fp32 *bf16 *fp32 *fp64 i32 i32 i32 i32 i32 i32 i32 i32 i32", NP=4,
          BLOCK_D=32, MIXP=32, PW=40, MIX_NEXT=True, STEPS=32, DOTS=False), 4, False),
    ("hc_mix_dot", hc_mix_dot_kernel,  # bf16 streams: fn in three bf16 parts, three MFMA dots (ROCm's tile)
     _sig("h_ptr fn_ptr part_ptr ROWS N D CHUNK MIX stride_h stride_fn stride_p stride_hn",
          "*bf16 *fp32 *fp64 i32 i32 i32 i32 i32 i32 i32 i32 i32", PW=40, MIXP=32, BLOCK_M=16, BLOCK_K=64,
          SPLIT_FN=True, num_stages=3), 4, True),
]

# Compiled for sm_90 only: the E4M3 hardware conversion (gfx90a has no FP8 units and takes the bit decode, base.py),
# the inline-PTX E2M1 decode (PRMT), the few-token tensor-core MXFP4 kernels (inline PTX mma.sync) and the prefill
# MoE's swapped 128-row dots (MOE_DOT on CUDA; ROCm keeps MOE_DOT_ROCM's forms), and attention's CUDA tiles.
_MMA_UP = ("x_ptr w_ptr s_ptr e_ptr rows_ptr part_ptr lock_ptr hb_ptr I D TOPK limit",
           "*bf16 *i32 *u8 *i64 *i32 *fp32 *i32 *bf16 i32 i32 i32 fp32")
_MMA_DOWN = ("hb_ptr w_ptr s_ptr e_ptr rows_ptr wt_ptr part_ptr lock_ptr out_ptr add_ptr D I TOPK",
             "*bf16 *i32 *u8 *i64 *i32 *fp32 *fp32 *i32 *bf16 *bf16 i32 i32 i32")
_MMA_ONE = ("x_ptr wu_ptr su_ptr wd_ptr sd_ptr e_ptr wt_ptr hx_ptr hb_ptr part_ptr I D limit",
            "*bf16 *i32 *u8 *i32 *u8 *i64 *fp32 *fp32 *bf16 *fp32 i32 i32 fp32")
ISA_SPECS_SM90: list[tuple[str, object, tuple[dict[str, str], dict[str, object]], int, bool]] = [
    ("fp8_stream_hw", fp8_stream_kernel,
     _sig(*_FP8_STREAM_ARGS, BLOCK_N=32, BLOCK_K=256, HW=True, UNIFORM=True, UNROLL=1, SPLIT=1, LOCAL=16), 4, False),
    ("attention_wide", attention_kernel,  # ATTN_WIDE as CUDA runs a prefill (ROCm: ATTN_WIDE_ROCM, above)
     _sig(_ATTN[0] + " cos_ptr sin_ptr HALF", _ATTN[1] + " *fp64 *fp64 i32", BLOCK_H=16, BLOCK_L=16,
          BLOCK_D=512, IEEE=False, SPLIT=False, CHUNK=0, part_ptr=None, ml_ptr=None, ROPE=True, SCAN=512), 2, True),
    ("attention_wide_split", attention_kernel,  # ATTN_WIDE_SPLIT (decode) on CUDA
     _sig(_ATTN[0] + " CHUNK part_ptr ml_ptr", _ATTN[1] + " i32 *fp32 *fp32",
          BLOCK_H=16, BLOCK_L=32, BLOCK_D=512, IEEE=False, SPLIT=True, GATHER=False, SCAN=256), 4, True),
    ("attention_wide_split_gather", attention_kernel,  # the same over a long context (ATTN_GATHER_KEYS)
     _sig(_ATTN[0] + " CHUNK part_ptr ml_ptr", _ATTN[1] + " i32 *fp32 *fp32",
          BLOCK_H=16, BLOCK_L=32, BLOCK_D=512, IEEE=False, SPLIT=True, GATHER=True, SCAN=256), 4, True),
    ("moe_gate_up_dot_swap", moe_gate_up_kernel,  # MOE_DOT on CUDA past 64 pairs an expert: 128 rows, acc^T
     _sig(*_MOE_UP, HAS_LIMIT=True, BLOCK_M=128, BLOCK_N=64, GROUPS=2, DOT=1, SWAP=True, num_stages=3), 4, True),
    ("moe_down_dot_swap", moe_down_kernel,  # MOE_DOT_DOWN's (ROCm runs neither: MOE_DOT_ROCM)
     _sig(*_MOE_DOWN, BLOCK_M=128, BLOCK_N=128, GROUPS=2, DOT=1, SWAP=True, num_stages=3), 8, True),
    ("fp8_stream_hw_long", fp8_stream_kernel,
     _sig(*_FP8_STREAM_ARGS, BLOCK_N=8, BLOCK_K=1024, HW=True, UNIFORM=True, UNROLL=1, SPLIT=2, SPLITP=2, LOCAL=16),
     4, False),
    ("fp8_stream_hw_prefetch", fp8_stream_kernel,
     _sig(*_FP8_WORDS_ARGS, BLOCK_N=32, BLOCK_K=256, HW=True, UNIFORM=True, UNROLL=1, SPLIT=1, PREFETCH=True,
          LOCAL=16), 4, False),
    ("moe_gate_up_stream_prmt", moe_gate_up_kernel,  # the default gate/up tile (MOE_STREAM) as it runs on sm_90
     _sig(_MOE_UP[0], _MOE_UP[1].replace("*u8 *u8 *u8 *u8", "*i32 *u8 *i32 *u8"),
          HAS_LIMIT=True, BLOCK_M=1, BLOCK_N=4, GROUPS=32, STREAM=True, PREFETCH=True, PRMT=True), 2, False),
    ("moe_mma_gate_up", moe_mma_gate_up_kernel,  # the few-token tensor-core MXFP4 (inline PTX mma.sync)
     _sig(*_MMA_UP, HAS_LIMIT=True, SPLIT=4, SPLITP=4, PDL=PDL_AVAILABLE), 1, True),
    ("moe_mma_gate_up_8", moe_mma_gate_up_kernel,  # one pair a row at 8-11 tokens (MOE_MMA SPLITS)
     _sig(*_MMA_UP, HAS_LIMIT=True, SPLIT=2, SPLITP=2, PDL=PDL_AVAILABLE), 1, True),
    ("moe_mma_gate_up_two", moe_mma_gate_up_kernel,  # two pairs of one expert a program row (12-64 tokens), with
     _sig(*_MMA_UP, HAS_LIMIT=True, SPLIT=2, SPLITP=2, TWO=True, PDL=PDL_AVAILABLE), 1, True),  # their K splits
    ("moe_mma_down", moe_mma_down_kernel,
     _sig(*_MMA_DOWN, SPLIT=2, TOPKP=8, SUM=True, HAS_ADD=True, PDL=PDL_AVAILABLE), 1, True),
    ("moe_mma_down_4", moe_mma_down_kernel,  # one pair a row at 4-11 tokens, unsplit
     _sig(*_MMA_DOWN, SPLIT=1, TOPKP=8, SUM=True, HAS_ADD=True, PDL=PDL_AVAILABLE), 1, True),
    ("moe_mma_down_two", moe_mma_down_kernel,  # (MOE_MMA SPLITS)
     _sig(*_MMA_DOWN, SPLIT=1, TOPKP=8, SUM=True, HAS_ADD=True, TWO=True, PDL=PDL_AVAILABLE), 1, True),
    ("moe_mma_one", moe_mma_one_kernel,  # one token split by channels (MOE_MMA_ONE): 64 channels, 8 warps
     _sig(*_MMA_ONE, HAS_LIMIT=True, CT=4, KS=2, PDL=PDL_AVAILABLE), 8, True),
    ("moe_mma_one_128", moe_mma_one_kernel,  # 128 channels (whole down tiles), 16 warps
     _sig(*_MMA_ONE, HAS_LIMIT=True, CT=8, KS=2, PDL=PDL_AVAILABLE), 16, True),
    ("moe_mma_one_sum", moe_mma_one_sum_kernel,
     _sig("part_ptr out_ptr add_ptr D N", "*fp32 *bf16 *bf16 i32 i32", HAS_ADD=True, ROWS=64, BLOCK_D=32,
          PDL=PDL_AVAILABLE), 4, False),
    ("moe_down_stream_prmt", moe_down_kernel,
     _sig(_MOE_DOWN[0], _MOE_DOWN[1].replace("*u8 *u8", "*i32 *u8"), BLOCK_M=1, BLOCK_N=16, GROUPS=8,
          STREAM=True, PRMT=True), 4, False),
    ("fp8_mma", fp8_mma_kernel,  # a few tokens' FP8 linear on the tensor cores (inline PTX mma.sync)
     _sig("x_ptr w_ptr s_ptr y_ptr part_ptr lock_ptr M R K stride_xm stride_xg stride_wn stride_sn stride_ym "
          "stride_yg stride_ps K_CHUNK", "*bf16 *u8 *u8 *bf16 *fp32 *i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32 i32",
          SPLIT=2, SPLITP=2), 1, True),
]
