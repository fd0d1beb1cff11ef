import torch, time, resource, sys
import torch.nn.functional as F
hw, c = 128*128, 512
mode = sys.argv[1]
x = torch.randn(1, c, hw)
def tok(t): 
    t = t.reshape(1,1,c,hw).transpose(-1,-2)
    return t.contiguous() if mode == "contig" else t
q=tok(x); k=tok(x*0.5); v=tok(x*0.1)
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t=time.perf_counter(); o=F.scaled_dot_product_attention(q,k,v); dt=time.perf_counter()-t
print(mode, f"{dt:.2f}s", "maxrss grew MB", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss-r0)/1024, o.float().sum().item())
