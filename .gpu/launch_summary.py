import json, sys
from collections import defaultdict
rows=[json.loads(l) for l in open(sys.argv[1])]
g=defaultdict(dict); cub={}; bad=0
for r in rows:
    k=(r['model'][:5],r['layer'],r['m'],r['tiling']['split_k'])
    if r['impl']=='cublas': cub[k]=r['us']; continue
    l=r['launch']; bad += not r['bitwise']
    key=(l['block_m'],l['block_n'],l['num_warps'],l['num_stages'],'F' if l.get('flush_in_loop') else ('R' if l['fuse_splits'] else 'old'))
    g[k][key]=r['us']
print('non-bitwise', bad)
for k,v in g.items():
    print(k, ' '.join('%s:%.2f'%(kk, cub[k]/v[kk]) for kk in sorted(v,key=lambda z: v[z])[:5]), '| old %.2f'%(cub[k]/[v[z] for z in v if z[4]=='old'][0]))
