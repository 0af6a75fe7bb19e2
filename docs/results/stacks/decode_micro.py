"""Dev: one decode step's attention (30 layers) over a corrected view at bench-like sizes: 12 requests'
factored groups of 4 segments each (the engine's default storage), ~1,800 corrected rows, 2,136 keys.
Before the stacks (3c67e73): 121.9 ms; after: about 70 ms (plain attention over the same keys: 8-12 ms).
Run: .venv/bin/python decode_micro.py"""
import time, torch
from kvcmas_agents.engine.lowrank import Coeffs, compress_joint
from kvcmas_agents.engine.realign import Realigner
from kvcmas_agents.engine.rope import inv_frequencies
from kvcmas_agents.engine.view_attention import OwnPiece, SegmentPiece
from kvcmas_agents.engine import view_gather as VG
torch.set_num_threads(2); torch.manual_seed(0)
L, KVH, G, D = 30, 3, 3, 64
inv, _ = inv_frequencies(D, 100000.0, None, 8192)
re = Realigner(inv.float())
slots = 6000
kc, vc = torch.randn(slots, KVH, D), torch.randn(slots, KVH, D)
pieces, pos, s = [OwnPiece(torch.arange(0, 80), torch.arange(80))], 80, 80
n_groups, segs_per, seg_len = 12, 4, 42   # ~2000 reused tokens
for gi in range(n_groups):
    n_rows = [int(seg_len * 0.9)] * segs_per
    dks = [torch.randn(L, KVH, r, D) * 0.1 for r in n_rows]
    states = compress_joint(dks, [d.flip(-1) for d in dks], [torch.arange(r) for r in n_rows], 40, torch.int8,
                            int8_basis=True, u8=28, head_bits=6, first_layer=4)
    for st in states:
        pieces.append(SegmentPiece(torch.arange(s, s + seg_len), torch.arange(pos, pos + seg_len), 5 + gi % 7, [st]))
        pos += seg_len; s += seg_len
pieces.append(OwnPiece(torch.arange(s, s + 40), torch.arange(pos, pos + 40)))
view = VG.build_view(pieces, re, torch.device("cpu"), torch.float32)
print("ctx", view.slots.numel(), "corrected rows", sum(st.rows.numel() for st in view.stacks),
      "groups", sum(len(st.groups) for st in view.stacks))
q = torch.randn(1, KVH * G, D)
def bench(fn, n=20):
    fn(); t = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - t) / n * 1e3
full = bench(lambda: [VG.gathered_attention(q, view, kc, vc, l, 0.125) for l in range(L)], 5)
print(f"kvcmas attention, 30 layers: {full:.1f} ms")
plain = VG.build_view([OwnPiece(view.slots, torch.arange(view.slots.numel()))], re, torch.device("cpu"), torch.float32)
print(f"plain (prefix-like) attention, 30 layers: {bench(lambda: [VG.gathered_attention(q, plain, kc, vc, l, 0.125) for l in range(L)], 5):.1f} ms")
l = 20

print(f"gathered_kv uncorrected: {bench(lambda: VG.gathered_kv(view, kc, vc, l, corrected=False, realigned=False)):.2f} ms")
qg = q.view(1, KVH, G, D).permute(1, 2, 0, 3).reshape(KVH, G, D)
k, v = VG.gathered_kv(view, kc, vc, l, corrected=False, realigned=False)
print(f"realigned scores: {bench(lambda: VG._realigned_scores(qg, k, view)):.2f} ms  (classes {view.q_cos.shape[0]})")

