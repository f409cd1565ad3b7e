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
    a.begin = tracked ? t.begin - r.origin : 0;
    a.end = tracked ? t.end - r.origin : 0;
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
    uint64_t begin, end;
    uint32_t task;
  };
  // Per private base, the accesses that still matter to later ones (as the tracker keeps them).
  std::vector<std::vector<Access>> reads(bases_), writes(bases_);
  auto overlaps = [](const Access& a, uint64_t b, uint64_t e) { return a.begin < e && b < a.end; };
  for (uint32_t i = 0; i < tasks_.size(); ++i) {
    Task& t = tasks_[i];
    for (const Arg& a : t.args) {
      if (!private_[a.base] || a.end <= a.begin) continue;
      const bool writes_it = (a.view.access & TD_WRITE) != 0;
      for (const Access& w : writes[a.base]) {
        if (w.task != i && overlaps(w, a.begin, a.end)) t.deps.push_back(w.task);
      }
      if (writes_it) {
        for (const Access& r : reads[a.base]) {
          if (r.task != i && overlaps(r, a.begin, a.end)) t.deps.push_back(r.task);
        }
        // Covered accesses: anything conflicting with them conflicts with this write, which follows them.
        auto covered = [&](const Access& x) { return x.task != i && a.begin <= x.begin && x.end <= a.end; };
        for (auto* list : {&writes[a.base], &reads[a.base]}) {
          list->erase(std::remove_if(list->begin(), list->end(), covered), list->end());
        }
        writers_[a.base].push_back(i);
      }
      (writes_it ? writes : reads)[a.base].push_back(Access{a.begin, a.end, i});
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

const std::vector<uint32_t>& Recording::writers(uint32_t base) const {
  static const std::vector<uint32_t> none;
  return base < writers_.size() ? writers_[base] : none;
}

}  // namespace tandem
