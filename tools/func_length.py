#!/usr/bin/env python3
"""Usage: tools/func_length.py [LIMIT=150] [DIR...=daemon]. Lists C++ functions longer than LIMIT lines (brace matching; strings, chars and comments skipped).
A function: a '{' at brace depth d whose preceding text (since the last ';', '{' or '}') ends in ')'
(optionally followed by const/override/noexcept/ABSL_... / -> type / ctor-initialisers), at
namespace or class scope. Lambdas inside bodies are part of their function."""
import re, sys, os
LIMIT = int(sys.argv[1]) if len(sys.argv) > 1 else 150
roots = sys.argv[2:] or ['daemon']
def strip(src):
    out = []; i = 0; n = len(src)
    while i < n:
        c = src[i]
        if src.startswith('//', i):
            j = src.find('\n', i); j = n if j < 0 else j; out.append(' ' * (j - i)); i = j
        elif src.startswith('/*', i):
            j = src.find('*/', i + 2); j = n if j < 0 else j + 2
            out.append(''.join(ch if ch == '\n' else ' ' for ch in src[i:j])); i = j
        elif src.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', src[i:]); d = m.group(1); j = src.find(')' + d + '"', i) + len(d) + 2
            out.append(''.join(ch if ch == '\n' else ' ' for ch in src[i:j])); i = j
        elif c in '"\'':
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == '\\' else 1
            out.append(c + ' ' * (j - i - 1) + c); i = j + 1
        else:
            out.append(c); i += 1
    return ''.join(out)
res = []
for root in roots:
    for dp, _, fs in os.walk(root):
        for f in fs:
            if not f.endswith(('.cc', '.h')): continue
            p = os.path.join(dp, f); s = strip(open(p, errors='replace').read())
            stack = []  # (kind, start_line)
            last = 0
            for i, c in enumerate(s):
                if c == '{':
                    head = s[last:i]
                    in_func = any(k == 'f' for k, _ in stack)
                    kind = 'b'
                    if not in_func:
                        h = re.sub(r'\s+', ' ', head).strip()
                        if re.search(r'\)\s*(const|override|final|noexcept|mutable|ABSL_[A-Z_]+\([^)]*\)|->\s*[\w:<>,\s*&]+|\s)*$', h) or re.search(r'\)\s*:\s*[\w:]+[({]', h):
                            if not re.match(r'^(if|for|while|switch|catch)\b', h.split(' ')[-1] if h else ''):
                                kind = 'f'
                    stack.append((kind, s.count('\n', 0, i) + 1)); last = i + 1
                elif c == '}':
                    if stack:
                        k, start = stack.pop()
                        if k == 'f':
                            end = s.count('\n', 0, i) + 1
                            if end - start + 1 > LIMIT: res.append((end - start + 1, p, start))
                    last = i + 1
                elif c == ';':
                    last = i + 1
for n, p, l in sorted(res, reverse=True): print(f'{n:5d} {p}:{l}')
print(f'# functions over {LIMIT} lines: {len(res)}', file=sys.stderr)
