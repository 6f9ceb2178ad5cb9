import json, os, sys, torch
sys.path.insert(0, "bench")
import decode_tail as bench
from g4serve.kernels.decode_tail import decode_tail_config, new_trace
from g4serve.kernels import decode_tail as dt
out = os.environ["OUT"]
res = {}
variants = [(8, 1, None), (8, 1, 64), (4, 1, None), (2, 1, None), (1, 1, None), (8, 8, None), (8, 8, 64)]
for preset in ("e4b", "31b"):
    h, q, i, p, _, ACT = bench.tail_shapes(preset)[0]; m = 1
    gen = torch.Generator("cuda").manual_seed(1)
    t = bench.Tail(h, q, i, p, gen)
    attn = torch.randn(m, q, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(m, h, device="cuda", generator=gen).bfloat16()
    per_layer = torch.randn(m, 8, p or 1, device="cuda", generator=gen).bfloat16()[:, 3]
    scale = torch.tensor([0.5], device="cuda", dtype=torch.bfloat16)
    for pps, grab, maxreg in variants:
        cfg = decode_tail_config(m, h, q, i, p) | {"programs_per_sm": pps, "grab": grab}
        if maxreg:
            cfg["max_registers"] = maxreg
        f = lambda tr=None: bench._fused_with(t, attn, residual, per_layer, scale, ACT, cfg, tr)
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        programs = pps * torch.cuda.get_device_properties(0).multi_processor_count
        tls = []
        for _ in range(2):
            tr = new_trace(programs, "cuda")
            f(tr)
            torch.cuda.synchronize()
            tls.append(bench.trace_timeline(tr, programs))
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        for _ in range(50):
            f()
        e.record(); torch.cuda.synchronize()
        r = {"eager_us": s.elapsed_time(e) / 50 * 1e3, "timelines": tls, "config": cfg}
        res[f"{preset}-pps{pps}-grab{grab}-maxreg{maxreg}"] = r
        tl = tls[-1]
        print(preset, "pps", pps, "grab", grab, "maxreg", maxreg, f"eager {r['eager_us']:.1f} us; {tl['programs']} programs start spread {tl['start_spread_us']:.1f} resident {tl['max_resident']} first ticket {tl['first_ticket_us']:.1f}; " + " ".join(f"{x['phase']} {x['last_out_us']:.1f}" for x in tl['phases']) + f"; exit {tl['last_exit_us']:.1f}", flush=True)
    del t
    torch.cuda.empty_cache()
k = dt._decode_tail.compiled
try:
    for dev, caches in k.device_caches.items():
        for key, ck in caches[0].items():
            print("kernel regs", ck.n_regs, "spills", ck.n_spills, "shared", ck.metadata.shared, "warps", ck.metadata.num_warps, "maxnreg", getattr(ck.metadata, "maxnreg", None))
except Exception as ex:
    print("no cache info", repr(ex))
json.dump(res, open(f"{out}/trace_programs.json", "w"), indent=1)
