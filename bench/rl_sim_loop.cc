#include <algorithm>
#include <vector>

#include "bench/rl_sim.h"

namespace wb::bench {

const char* SimModeName(SimMode m) {
  switch (m) {
    case SimMode::kSync: return "sync";
    case SimMode::kOneStepOff: return "one_step_off";
    case SimMode::kAsync: return "async";
  }
  return "?";
}

namespace {

// Background transfer pipe of the non-blocking strategy: one version at a time; a version
// published while another is in flight waits, and a newer one supersedes it while waiting.
struct Pipe {
  double free_at = 0;
  std::vector<double> arrival;  // per version (index = version), < 0: superseded / not sent
  double queued_publish = -1;   // publish time of the newest waiting version
  int queued_version = 0;

  void Publish(int v, double t, double x) {
    if (static_cast<int>(arrival.size()) <= v) arrival.resize(v + 1, -1);
    Drain(t, x);
    if (free_at <= t) {
      free_at = t + x;
      arrival[v] = free_at;
    } else {
      queued_version = v;  // supersedes any older waiting version
      queued_publish = t;
    }
  }
  // Starts the waiting version if the pipe became free by time t.
  void Drain(double t, double x) {
    if (queued_version > 0 && free_at <= t) {
      free_at = std::max(free_at, queued_publish) + x;
      arrival[queued_version] = free_at;
      queued_version = 0;
    }
  }
  // Newest version committed by time t (0 = none).
  int NewestBy(double t, double x) {
    Drain(t, x);
    for (int v = static_cast<int>(arrival.size()) - 1; v > 0; --v) {
      if (arrival[v] >= 0 && arrival[v] <= t) return v;
    }
    return 0;
  }
  // When version >= v is committed (after flushing the queue).
  double ArrivalOfAtLeast(int v, double x) {
    Drain(1e300, x);
    double best = 1e300;
    for (int u = v; u < static_cast<int>(arrival.size()); ++u) {
      if (arrival[u] >= 0) best = std::min(best, arrival[u]);
    }
    return best;
  }
};

}  // namespace

SimResult SimulateLoop(SimMode mode, const SimParams& p) {
  const int n = std::max(1, p.steps);
  const double T = p.train_s, R = p.rollout_s, X = p.transfer_s;
  double stall_t = 0, stall_r = 0, t_free = 0, end = 0;
  int applied = 0;
  if (mode == SimMode::kSync) {
    // Same for every strategy: both sides held for the transfer after each step.
    double t = 0;
    for (int b = 1; b <= n; ++b) t += R + T + X;
    return {X, X, t / n, n};
  }
  if (mode == SimMode::kOneStepOff) {
    // rend[b]: end of generating batch b (batch b uses v(b-2); batches 1, 2 use v0).
    std::vector<double> rend(n + 3, 0), tend(n + 2, 0);
    Pipe pipe;
    rend[1] = R;
    rend[2] = 2 * R;
    for (int b = 1; b <= n; ++b) {
      double start = std::max(t_free, rend[b]);
      tend[b] = start + T;  // -> v(b)
      if (p.blocking) {
        // Collective when the trainer finished step b and the rollout finished batch b+1.
        double u = std::max(tend[b], rend[b + 1]);
        stall_t += X;
        stall_r += X;
        t_free = u + X;
        rend[b + 2] = u + X + R;  // batch b+2 uses v(b)
      } else {
        stall_t += p.snapshot_s;
        double pub = tend[b] + p.snapshot_s;
        t_free = pub;
        pipe.Publish(b, pub, X);
        double boundary = rend[b + 1];
        double ready = pipe.ArrivalOfAtLeast(b, X);
        double ideal = std::max(boundary, tend[b]);  // an instant transfer still needs v(b) to exist
        double go = std::max(boundary, ready);
        stall_r += (go - ideal) + p.apply_s;
        rend[b + 2] = go + p.apply_s + R;
      }
      ++applied;
      end = std::max(end, t_free);
    }
    return {stall_t / n, stall_r / n, end / n, applied};
  }
  // async: rollout batches back to back; the trainer takes batch b when it is generated.
  std::vector<double> rend(n + 2, 0);
  Pipe pipe;
  double r_time = 0;
  int live = 0;
  int next_batch = 1;
  std::vector<double> pending_interrupts;  // blocking: collective start times not yet absorbed
  for (int b = 1; b <= n; ++b) {
    // Generate batches until batch b exists.
    while (next_batch <= b) {
      double gen_end = r_time + R;
      if (p.blocking) {
        // Collectives started during this generation interrupt it for X each.
        for (double u : pending_interrupts) {
          if (u < gen_end) gen_end += X;
        }
        pending_interrupts.erase(std::remove_if(pending_interrupts.begin(), pending_interrupts.end(),
                                                [&](double u) { return u < gen_end; }),
                                 pending_interrupts.end());
      } else {
        int newest = pipe.NewestBy(r_time, X);
        if (newest > live) {
          live = newest;
          ++applied;
          stall_r += p.apply_s;
          gen_end += p.apply_s;
        }
      }
      rend[next_batch++] = gen_end;
      r_time = gen_end;
    }
    double start = std::max(t_free, rend[b]);
    double tend = start + T;
    if (p.blocking) {
      pending_interrupts.push_back(tend);  // the rollout is interrupted now (or at once if idle)
      stall_t += X;
      stall_r += X;
      ++applied;
      t_free = tend + X;
    } else {
      stall_t += p.snapshot_s;
      t_free = tend + p.snapshot_s;
      pipe.Publish(b, t_free, X);
    }
    end = std::max(end, t_free);
  }
  return {stall_t / n, stall_r / n, end / n, applied};
}

}  // namespace wb::bench
