#include "tandem/capture.hpp"

#include <algorithm>
#include <string>

#include "tandem/errors.hpp"

namespace tandem {

void Recording::add(const PreparedCall& call, const std::vector<RecordedRef>& refs) {
  if (sealed_) throw InvalidArgument("recording: sealed, no more tasks");
  if (refs.size() != call.tensors.size()) {
    throw InvalidArgument("recording: " + std::to_string(call.tensors.size()) + " tensors but " +
                          std::to_string(refs.size()) + " bases");
  }
  Task task;
  task.kernel = call.kernel;
  task.scalars = call.scalars;
  task.args.reserve(refs.size());
  size_t bases = bases_;
  for (size_t i = 0; i < refs.size(); ++i) {
    const TensorArg& t = call.tensors[i];
    const RecordedRef& r = refs[i];
    const bool tracked = t.alloc_id != 0 && t.end > t.begin;
    if (tracked && t.begin < r.origin) {
      throw InvalidArgument("recording: tensor " + std::to_string(i) + " starts before its base");
    }
    Arg a;
    a.view = t.view;
    a.view.access = call.access[i];
    a.base = r.base;
    a.data_offset = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.view.data) - r.addr);
    // The pitch residues shift with the origin alike for every access of one base: overlap is unchanged.
    if (tracked) a.span = span_of(t.view, t.begin - r.origin, t.end - r.origin);
    task.args.push_back(a);
    bases = std::max(bases, static_cast<size_t>(r.base) + 1);
  }
  tasks_.push_back(std::move(task));
  bases_ = bases;
}

void Recording::seal(const std::vector<uint32_t>& private_bases) {
  if (sealed_) throw InvalidArgument("recording: sealed already");
  private_.assign(bases_, false);
  for (uint32_t b : private_bases) {
    if (b < bases_) private_[b] = true;
  }
  writers_.assign(bases_, {});
  struct Access {
    Span span;
    uint32_t task;
  };
  // Per private base, the accesses that still matter to later ones (as the tracker keeps them).
  std::vector<std::vector<Access>> reads(bases_), writes(bases_);
  for (uint32_t i = 0; i < tasks_.size(); ++i) {
    Task& t = tasks_[i];
    for (const Arg& a : t.args) {
      if (!private_[a.base] || a.span.end <= a.span.begin) continue;
      const bool writes_it = (a.view.access & TD_WRITE) != 0;
      for (const Access& w : writes[a.base]) {
        if (w.task != i && may_overlap(w.span, a.span)) t.deps.push_back(w.task);
      }
      if (writes_it) {
        for (const Access& r : reads[a.base]) {
          if (r.task != i && may_overlap(r.span, a.span)) t.deps.push_back(r.task);
        }
        // Covered accesses: anything conflicting with them conflicts with this write, which follows them.
        auto covered = [&](const Access& x) { return x.task != i && covers(a.span, x.span); };
        for (auto* list : {&writes[a.base], &reads[a.base]}) {
          list->erase(std::remove_if(list->begin(), list->end(), covered), list->end());
        }
        writers_[a.base].push_back(i);
      }
      (writes_it ? writes : reads)[a.base].push_back(Access{a.span, i});
    }
    std::sort(t.deps.begin(), t.deps.end());
    t.deps.erase(std::unique(t.deps.begin(), t.deps.end()), t.deps.end());
  }
  for (auto& w : writers_) w.erase(std::unique(w.begin(), w.end()), w.end());
  for (uint32_t i = 0; i < tasks_.size(); ++i) {
    for (uint32_t dep : tasks_[i].deps) tasks_[dep].dependents.push_back(i);
  }
  sealed_ = true;
}

ReplayPlan::ReplayPlan(std::shared_ptr<const Recording> recording, const std::vector<ReplayBase>& bases)
    : recording_(std::move(recording)) {
  if (!recording_) throw InvalidArgument("replay plan: no recording");
  const Recording& rec = *recording_;
  if (!rec.sealed()) throw InvalidArgument("replay plan: the recording is not sealed");
  if (bases.size() < rec.base_count()) {
    throw InvalidArgument("replay plan: the recording names " + std::to_string(rec.base_count()) + " bases, got " +
                          std::to_string(bases.size()));
  }
  const std::vector<Recording::Task>& tasks = rec.tasks();
  size_t n_views = 0, n_scalars = 0;
  for (const Recording::Task& t : tasks) {
    n_views += t.args.size();
    n_scalars += t.scalars.size();
  }
  entries_.reserve(tasks.size());
  views_.reserve(n_views);
  scalars_.reserve(n_scalars);
  for (uint32_t i = 0; i < tasks.size(); ++i) {
    const Recording::Task& t = tasks[i];
    Entry e;
    e.fn = t.kernel.get();
    e.first_view = static_cast<uint32_t>(views_.size());
    e.n_views = static_cast<int32_t>(t.args.size());
    e.first_scalar = static_cast<uint32_t>(scalars_.size());
    e.n_scalars = static_cast<int32_t>(t.scalars.size());
    e.n_deps = static_cast<int32_t>(t.deps.size());
    e.dependents = t.dependents.data();
    e.n_dependents = static_cast<uint32_t>(t.dependents.size());
    entries_.push_back(e);
    for (const Recording::Arg& a : t.args) {
      const ReplayBase& b = bases[a.base];
      td_tensor v = a.view;
      v.data = reinterpret_cast<void*>(b.addr + static_cast<uintptr_t>(a.data_offset));
      views_.push_back(v);
      if (!rec.is_private(a.base) && b.alloc_id != 0 && a.span.end > a.span.begin) {
        Span s = a.span;
        s.begin += b.origin;
        s.end += b.origin;
        shared_.push_back(SharedAccess{i, a.view.access, b.alloc_id, s});
      }
    }
    scalars_.insert(scalars_.end(), t.scalars.begin(), t.scalars.end());
  }
}

const std::vector<uint32_t>& Recording::writers(uint32_t base) const {
  static const std::vector<uint32_t> none;
  return base < writers_.size() ? writers_[base] : none;
}

}  // namespace tandem
