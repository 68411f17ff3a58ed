#include "planner/sender_quant.h"

#include "planner/box.h"
#include "planner/quantized.h"

namespace wb::planner {

bool SenderCanQuantize(const Quantization& q) {
  if (q.dtype == DType::kF8E4M3) return q.scale_dtype == DType::kF32 || q.scale_dtype == DType::kE8M0;
  if (q.dtype == DType::kI4) {
    // Whole bytes per op: the packed pairs run along the last dim, so its groups must be even.
    return (q.scale_dtype == DType::kBF16 || q.scale_dtype == DType::kF16 || q.scale_dtype == DType::kF32) &&
           !q.block.empty() && q.block.back() % 2 == 0;
  }
  return false;
}

SenderQuantization DecideSenderQuantization(const Problem& p, const FragmentSet& fs, bool enabled) {
  const size_t nf = fs.fragments.size();
  SenderQuantization out;
  out.quantized.assign(nf, 0);
  out.wire_bytes.resize(nf);
  out.format.assign(nf, nullptr);
  for (size_t i = 0; i < nf; ++i) out.wire_bytes[i] = fs.fragments[i].bytes;
  if (!enabled) return out;

  // Candidate flags per rollout piece (indexed by worker, then piece).
  std::vector<size_t> base(p.workers.size() + 1, 0);
  for (size_t w = 0; w < p.workers.size(); ++w) base[w + 1] = base[w] + p.workers[w].layout.pieces.size();
  std::vector<uint8_t> eligible(base.back(), 0);
  bool any = false;
  for (size_t w = 0; w < p.workers.size(); ++w) {
    const Worker& wk = p.workers[w];
    if (wk.role != Role::kRollout) continue;
    for (size_t i = 0; i < wk.layout.pieces.size(); ++i) {
      const Piece& pc = wk.layout.pieces[i];
      // Worth it when the piece's quantised bytes are fewer than its canonical ones (a per-piece
      // test: the same for any split of its fragments).
      eligible[base[w] + i] = pc.quant.has_value() && SenderCanQuantize(*pc.quant) &&
                              QuantizedBoxBytes(pc.box, *pc.quant) <
                                  BoxVolume(pc.box) * DTypeSize(p.inventory.tensors[pc.tensor].dtype);
      any |= eligible[base[w] + i] != 0;
    }
  }
  if (!any) return out;
  auto piece_of = [&](PieceRef r) -> const Piece& { return p.workers[r.worker].layout.pieces[r.piece]; };
  auto flag = [&](PieceRef r) -> uint8_t& { return eligible[base[r.worker] + r.piece]; };

  // Fixpoint: a fragment that cannot travel quantised to all its needers demotes all of them.
  // Eligibility only ever drops, so this ends (each pass but the last demotes a piece); in
  // practice one or two passes.
  bool changed = true;
  while (changed) {
    changed = false;
    for (size_t i = 0; i < nf; ++i) {
      const Fragment& f = fs.fragments[i];
      if (f.dst_begin == f.dst_end) continue;
      const Piece& first = piece_of(fs.refs[f.dst_begin]);
      bool ok = true;
      for (uint32_t k = f.dst_begin; k < f.dst_end && ok; ++k) {
        const PieceRef r = fs.refs[k];
        ok = flag(r) != 0 && SameQuantFormat(*piece_of(r).quant, *first.quant);
      }
      ok = ok && BoxOnBlockGrid(f.box, p.inventory.tensors[f.tensor].shape, first.quant->block);
      if (ok) continue;
      for (uint32_t k = f.dst_begin; k < f.dst_end; ++k) {
        uint8_t& e = flag(fs.refs[k]);
        changed |= e != 0;
        e = 0;
      }
    }
  }
  for (size_t i = 0; i < nf; ++i) {
    const Fragment& f = fs.fragments[i];
    if (f.dst_begin == f.dst_end || !flag(fs.refs[f.dst_begin])) continue;
    // At the fixpoint every needer is eligible, in one format, and the box is on its grid.
    const Quantization* q = &*piece_of(fs.refs[f.dst_begin]).quant;
    out.quantized[i] = 1;
    out.format[i] = q;
    out.wire_bytes[i] = QuantizedBoxBytes(f.box, *q);
  }
  return out;
}

}  // namespace wb::planner
