#include "planner/sender_quant.h"

#include <vector>

#include "absl/strings/str_cat.h"
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

SenderQuantization DecideSenderQuantization(const Problem& p, const FragmentSet& fs, bool enabled, bool from_quantized_holders) {
  return *DecideSenderQuantization(p, fs, enabled, nullptr, from_quantized_holders);  // no check: never stops
}

absl::StatusOr<SenderQuantization> DecideSenderQuantization(const Problem& p, const FragmentSet& fs, bool enabled,
                                                            CancelPoll* cancel, bool from_quantized_holders) {
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
  auto flat = [&](PieceRef r) { return base[r.worker] + r.piece; };
  auto tick = [&](int64_t units) { return cancel == nullptr || cancel->Tick(units); };
  auto stopped = [&](absl::string_view what, size_t i, size_t n) {
    return cancel->Stopped(absl::StrCat("deciding sender-side quantisation: ", what, " ", i, " of ", n));
  };

  // The greatest set of pieces such that every fragment with a needer in it has all its needers in
  // it, in one format, and lies on their block grid (a fixpoint: demotion only ever removes pieces).
  // A fragment that fails demotes all its needers (`bad`, each fragment at most once); a demoted
  // piece makes every fragment it needs fail. First every fragment is checked once, in order; the
  // pieces it demoted then demote, through a piece -> fragments index built only when some piece
  // was demoted, the other needers of their fragments, and so on. Every fragment is marked bad at
  // most once and every piece demoted at most once: linear in the refs. The result is the fixpoint
  // the repeated passes reached (it does not depend on the order of demotions), so plans are
  // unchanged (planner_test's pinned fingerprints, SenderQuantisationChainOfDemotions).
  std::vector<uint8_t> bad(nf, 0);
  std::vector<size_t> demoted;  // pieces demoted, waiting to demote the fragments they need
  auto fail = [&](size_t i) {
    bad[i] = 1;
    const Fragment& f = fs.fragments[i];
    for (uint32_t k = f.dst_begin; k < f.dst_end; ++k) {
      uint8_t& e = eligible[flat(fs.refs[k])];
      if (e != 0) demoted.push_back(flat(fs.refs[k]));
      e = 0;
    }
  };
  for (size_t i = 0; i < nf; ++i) {
    const Fragment& f = fs.fragments[i];
    if (!tick(1 + (f.dst_end - f.dst_begin))) return stopped("checking fragment", i, nf);
    if (f.dst_begin == f.dst_end) continue;
    const Piece& first = piece_of(fs.refs[f.dst_begin]);
    bool ok = true;
    for (uint32_t k = f.dst_begin; k < f.dst_end && ok; ++k) {
      const PieceRef r = fs.refs[k];
      ok = eligible[flat(r)] != 0 && SameQuantFormat(*piece_of(r).quant, *first.quant);
    }
    ok = ok && BoxOnBlockGrid(f.box, p.inventory.tensors[f.tensor].shape, first.quant->block);
    if (ok && from_quantized_holders) {
      // Nobody quantises: some holder must already hold the box in the needers' format.
      bool held = false;
      for (uint32_t k = f.src_begin; k < f.src_end && !held; ++k) {
        const Piece& h = piece_of(fs.refs[k]);
        held = h.quant.has_value() && SameQuantFormat(*h.quant, *first.quant);
      }
      ok = held;
    }
    if (!ok) fail(i);
  }
  if (!demoted.empty()) {
    // Piece -> the fragments it needs (CSR over the flat piece index).
    std::vector<uint32_t> off(base.back() + 1, 0);
    for (size_t i = 0; i < nf; ++i) {
      const Fragment& f = fs.fragments[i];
      for (uint32_t k = f.dst_begin; k < f.dst_end; ++k) ++off[flat(fs.refs[k]) + 1];
    }
    for (size_t x = 0; x + 1 < off.size(); ++x) off[x + 1] += off[x];
    std::vector<uint32_t> needs(off.back());
    std::vector<uint32_t> fill(off.begin(), off.end() - 1);
    for (size_t i = 0; i < nf; ++i) {
      const Fragment& f = fs.fragments[i];
      if (!tick(1 + (f.dst_end - f.dst_begin))) return stopped("indexing fragment", i, nf);
      for (uint32_t k = f.dst_begin; k < f.dst_end; ++k) needs[fill[flat(fs.refs[k])]++] = static_cast<uint32_t>(i);
    }
    size_t done = 0;
    while (!demoted.empty()) {
      const size_t piece = demoted.back();
      demoted.pop_back();
      ++done;
      for (uint32_t x = off[piece]; x < off[piece + 1]; ++x) {
        const uint32_t i = needs[x];
        if (bad[i]) continue;
        if (!tick(1 + (fs.fragments[i].dst_end - fs.fragments[i].dst_begin))) {
          return stopped("demoting the needers of demoted pieces: piece", done, done + demoted.size());
        }
        fail(i);
      }
    }
  }
  for (size_t i = 0; i < nf; ++i) {
    const Fragment& f = fs.fragments[i];
    if (f.dst_begin == f.dst_end || !eligible[flat(fs.refs[f.dst_begin])]) continue;
    // At the fixpoint every needer is eligible, in one format, and the box is on its grid.
    const Quantization* q = &*piece_of(fs.refs[f.dst_begin]).quant;
    out.quantized[i] = 1;
    out.format[i] = q;
    out.wire_bytes[i] = QuantizedBoxBytes(f.box, *q);
  }
  return out;
}

absl::Status KeepServingHolders(const Problem& p, const SenderQuantization& sq, FragmentSet& fs) {
  std::vector<PieceRef> refs;
  refs.reserve(fs.refs.size());
  for (size_t i = 0; i < fs.fragments.size(); ++i) {
    Fragment& f = fs.fragments[i];
    const Quantization* format = i < sq.quantized.size() && sq.quantized[i] ? sq.format[i] : nullptr;
    const uint32_t src_begin = static_cast<uint32_t>(refs.size());
    for (uint32_t k = f.src_begin; k < f.src_end; ++k) {
      const Piece& h = p.workers[fs.refs[k].worker].layout.pieces[fs.refs[k].piece];
      const bool serves = format != nullptr ? h.quant.has_value() && SameQuantFormat(*h.quant, *format) : !h.quant.has_value();
      if (serves) refs.push_back(fs.refs[k]);
    }
    const uint32_t src_end = static_cast<uint32_t>(refs.size());
    if (src_begin == src_end && f.dst_begin != f.dst_end) {
      const Worker& dw = p.workers[fs.refs[f.dst_begin].worker];
      const Piece& need = dw.layout.pieces[fs.refs[f.dst_begin].piece];
      std::string form;
      if (format != nullptr) {
        form = absl::StrCat("quantised as ", DTypeName(format->dtype), " with ", DTypeName(format->scale_dtype), " scales, as ", dw.id, " needs it");
      } else {
        form = absl::StrCat("in the canonical dtype, as ", dw.id, " needs it");
        if (need.quant.has_value()) {
          absl::StrAppend(&form, " (it holds the box as ", DTypeName(need.quant->dtype),
                          "; a source's quantised bytes serve it only in the same format, on whole blocks, in a format senders copy)");
        }
      }
      return absl::FailedPreconditionError(absl::StrCat("no source holds box ", BoxToString(f.box), " of tensor ",
                                                        p.inventory.tensors[f.tensor].name, " ", form,
                                                        ": the sources hold it only quantised"));
    }
    const uint32_t dst_begin = static_cast<uint32_t>(refs.size());
    for (uint32_t k = f.dst_begin; k < f.dst_end; ++k) refs.push_back(fs.refs[k]);
    f.src_begin = src_begin;
    f.src_end = src_end;
    f.dst_begin = dst_begin;
    f.dst_end = static_cast<uint32_t>(refs.size());
  }
  fs.refs = std::move(refs);
  return absl::OkStatus();
}

}  // namespace wb::planner
