"""Cut whole documents from a CoNLL-U file: every k-th document (k = documents // 40) from the
first, until at least N sentences (docs/tenney_comparison.md). Usage: python gum_subset.py SRC DST N"""

import sys


def documents(path):
    out, cur, block = [], [], []
    for line in open(path, encoding="utf-8"):
        block.append(line)
        if line.strip() == "":
            text = "".join(block)
            block = []
            if "# newdoc" in text and cur:
                out.append(cur)
                cur = []
            cur.append(text)
    if block:
        cur.append("".join(block))
    if cur:
        out.append(cur)
    return out


def main(src, dst, n):
    ds = documents(src)
    k = max(1, len(ds) // 40)
    picked, total = [], 0
    for i in list(range(0, len(ds), k)) + [i for i in range(len(ds)) if i % k]:
        if total >= n:
            break
        picked.append(i)
        total += len(ds[i])
    with open(dst, "w", encoding="utf-8") as f:
        for i in sorted(picked):
            f.write("".join(ds[i]))
    print(dst, len(picked), "documents,", total, "sentences")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
