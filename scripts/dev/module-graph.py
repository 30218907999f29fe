#!/usr/bin/env python3
"""The crate's module import graph at a git revision, and its cycles.

    scripts/dev/module-graph.py REV [DEPTH]   # e.g. HEAD 2: edges between daemon::batcher, daemon::device, ...

Reads `use crate::…` / `super::…` paths (not comments, not test modules)
of every file under src/ except src/bin, folds them to DEPTH path segments,
and prints the top-level modules, the strongly connected components with
more than one member (cycles), and every edge.
"""
import os,re,sys,subprocess,collections
rev=sys.argv[1]; repo=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
files=subprocess.run(['git','-C',repo,'ls-tree','-r','--name-only',rev,'src'],capture_output=True,text=True).stdout.split()
files=[f for f in files if f.endswith('.rs') and not f.startswith('src/bin/')]
def mod_of(f):
    p=f[4:-3].split('/')
    if p[-1] in ('mod','lib','main'): p=p[:-1]
    return p
depth=int(sys.argv[2]) if len(sys.argv)>2 else 1
edges=collections.defaultdict(set)
for f in files:
    src=subprocess.run(['git','-C',repo,'show',f'{rev}:{f}'],capture_output=True,text=True).stdout
    # strip tests
    src=re.split(r'#\[cfg\(test\)\]',src)[0]; src='\n'.join(l for l in src.split('\n') if not l.strip().startswith('//'))
    me=mod_of(f)
    if not me: continue
    a='::'.join(me[:depth])
    for m in re.finditer(r'crate::([a-z_]+)(?:::([a-z_]+))?',src):
        parts=[m.group(1)]+([m.group(2)] if m.group(2) else [])
        b='::'.join(parts[:depth])
        if b!=a and not a.startswith(b+'::') and not b.startswith(a+'::'): edges[a].add(b)
    for m in re.finditer(r'super::([a-z_]+)',src):
        base=me[:-1] if f.endswith('mod.rs')==False else me[:-1]
        parts=base+[m.group(1)]
        b='::'.join(parts[:depth])
        if b!=a: edges[a].add(b)
nodes=sorted(set(edges)|{b for v in edges.values() for b in v})
# cycles via SCC
idx={};low={};st=[];on=set();sccs=[];c=[0]
def sc(v):
    idx[v]=low[v]=c[0];c[0]+=1;st.append(v);on.add(v)
    for w in edges.get(v,()):
        if w not in idx: sc(w);low[v]=min(low[v],low[w])
        elif w in on: low[v]=min(low[v],idx[w])
    if low[v]==idx[v]:
        s=[]
        while True:
            w=st.pop();on.discard(w);s.append(w)
            if w==v:break
        if len(s)>1:sccs.append(sorted(s))
for v in nodes:
    if v not in idx: sc(v)
top=sorted({mod_of(f)[0] for f in files if mod_of(f)})
print(rev,'top-level modules:',len(top),top)
print('cycles (depth %d):'%depth,sccs if sccs else 'none')
for a in sorted(edges): print(' ',a,'->',', '.join(sorted(edges[a])))
