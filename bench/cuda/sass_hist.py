"""Opcode histogram of one kernel's SASS (cuobjdump -sass output on stdin).

    cuobjdump -sass obj.o | python3 sass_hist.py NAME_SUBSTRING
Counts static instructions of the first function whose name contains the
substring, by opcode (modifiers dropped), and by the pipe class we care
about for the INT2 loop (integer/logic vs FMA vs tensor vs memory).
"""
import collections
import re
import sys

want = sys.argv[1]
cur, hist = None, collections.Counter()
for line in sys.stdin:
    m = re.match(r"\s*Function : (\S+)", line)
    if m:
        if cur is not None and hist:
            break
        cur = m.group(1) if want in m.group(1) else None
        continue
    if cur is None:
        continue
    m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?", line)
    if m:
        hist[m.group(2)] += 1
if not hist:
    sys.exit(f"no function matching {want}")
alu = {"LOP3", "SHF", "PRMT", "IADD3", "LEA", "ISETP", "FSEL", "SEL", "FMNMX", "IMNMX", "LOP", "BMSK", "SGXT", "FSETP", "PLOP3", "P2R", "R2P", "VIADD", "VIMNMX"}
fma = {"FFMA", "FMUL", "FADD", "IMAD", "HFMA2", "HADD2", "HMUL2", "FFMA2"}
tot = sum(hist.values())
print(f"{tot} static instructions; top opcodes:")
for op, n in hist.most_common(30):
    print(f"  {op:10s} {n:6d}  {'ALU' if op in alu else 'FMA' if op in fma else ''}")
print("ALU-class", sum(n for op, n in hist.items() if op in alu), "FMA-class", sum(n for op, n in hist.items() if op in fma))
