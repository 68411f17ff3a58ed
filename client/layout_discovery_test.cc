// Layout discovery through the C++ worker client against a real standalone weightbridged process
// (tests/e2e/harness): DescribeLayout before anything is registered sizes the buffers, trainers fill
// their Megatron local tensors through View(), a vLLM rollout's framework tensors (fused qkv_proj,
// embedding) read back exactly the canonical values after a version moved.
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/layout_command.h"
#include "client/worker_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/harness.h"

namespace wb::client {
namespace {

using ::testing::HasSubstr;

// Canonical value of element `flat` of tensor `name` (a test-local function: both sides compute it).
uint16_t Value(const std::string& name, int64_t flat) {
  const uint64_t h = std::hash<std::string>()(name);
  return static_cast<uint16_t>((h * 31 + static_cast<uint64_t>(flat) * 2654435761u) >> 7);
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Calls fn(flat index in the canonical tensor, byte offset from the piece's start) for every
// element of `p`'s box (bf16 pieces).
void ForEachElement(const pb::Piece& p, const std::vector<int64_t>& tensor_shape,
                    const std::function<void(int64_t, int64_t)>& fn) {
  const int r = p.box().begin_size();
  std::vector<int64_t> c(p.box().begin().begin(), p.box().begin().end());
  for (int d = 0; d < r; ++d) {
    if (p.box().end(d) <= p.box().begin(d)) return;
  }
  while (true) {
    int64_t flat = 0, off = 0;
    for (int d = 0; d < r; ++d) {
      flat = flat * tensor_shape[d] + c[d];
      off += (c[d] - p.box().begin(d)) * p.strides(d) * 2;
    }
    fn(flat, off);
    int d = r - 1;
    while (d >= 0 && ++c[d] == p.box().end(d)) {
      c[d] = p.box().begin(d);
      --d;
    }
    if (d < 0) return;
  }
}

class LayoutDiscoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto h = e2e::Harness::Create("wblayout");
    ASSERT_TRUE(h.ok()) << h.status();
    harness_ = std::move(*h);
    socket_ = harness_->Path("w.sock");
    auto p = harness_->Spawn("daemon", {e2e::Runfile("daemon/weightbridged"), "--role=standalone", "--worker_socket=" + socket_,
                                        "--listen=127.0.0.1:0", "--port_file=" + harness_->Path("port")});
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(harness_->WaitForPortFile(harness_->Path("port"), absl::Seconds(30), *p).ok()) << (*p)->LogTail();
    model_.model_id = "m";
    model_.hf_config_json = ReadFile(e2e::Runfile("tests/soak/testdata/qwen2-tiny.json"));
    ASSERT_FALSE(model_.hf_config_json.empty());
    model_.num_trainer_workers = 2;
    model_.num_rollout_workers = 1;
    model_.mode = Mode::kOneStepOff;
  }

  std::unique_ptr<WorkerClient> Connect() {
    ClientOptions o;
    o.shm_prefix = "layout";
    auto c = WorkerClient::Connect(socket_, o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  std::unique_ptr<e2e::Harness> harness_;
  std::string socket_;
  ModelConfig model_;
};

PresetLayout Megatron(uint32_t rank) {
  PresetLayout p;
  p.preset = "megatron";
  p.tp = 2;
  p.rank = rank;
  return p;
}

TEST_F(LayoutDiscoveryTest, DescribeBeforeRegisteringSizesBuffersAndViewsCarryAVersion) {
  // Before registering: the node does not know the model, the spec travels with the request.
  auto pre = Connect();
  ASSERT_NE(pre, nullptr);
  EXPECT_EQ(pre->DescribeLayout(Megatron(0)).status().code(), absl::StatusCode::kFailedPrecondition);
  auto described = pre->DescribeLayout(Megatron(0), &model_);
  ASSERT_TRUE(described.ok()) << described.status();
  ASSERT_EQ(described->buffers.size(), 1u);
  const int64_t size = described->BufferBytes(0);
  ASSERT_GT(size, 0);
  EXPECT_EQ(described->source, "preset");
  // tp=2 of 4 heads / 2 KV groups of 64: one group per rank, (2 + 1 + 1) * 64 rows.
  const LocalTensorPlace* qkv = described->Find("decoder.layers.1.self_attention.linear_qkv.weight");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->shape, (std::vector<int64_t>{256, 256}));
  EXPECT_EQ(qkv->strides, (std::vector<int64_t>{256, 1}));
  EXPECT_EQ(qkv->offset_bytes % 256, 0);
  EXPECT_EQ(qkv->pieces.size(), 3u);
  EXPECT_EQ(pre->DescribeLayout(PresetLayout{"megatron", 3}, &model_).status().code(), absl::StatusCode::kInvalidArgument);

  // A buffer one byte short is refused naming worker, model and both sizes; nothing registered.
  ASSERT_TRUE(pre->RegisterWorker(model_, {"trainer/0", planner::Role::kTrainer, -1}).ok());
  ASSERT_TRUE(pre->CreateBuffer(size - 1).ok());
  auto refused = pre->RegisterLayout(Megatron(0));
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr(absl::StrCat("worker trainer/0 of model m, preset megatron rank 0: buffer 0 needs ", size, " bytes, registered ",
                                     size - 1)));
  ASSERT_TRUE(pre->Deregister().ok());
  pre.reset();

  // The rollout (vLLM tp=1) holds every canonical tensor whole: its pieces give the canonical shapes.
  PresetLayout vllm;
  vllm.preset = "vllm";
  auto ro = Connect();
  ASSERT_NE(ro, nullptr);
  auto rd = ro->DescribeLayout(vllm, &model_);
  ASSERT_TRUE(rd.ok()) << rd.status();
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const pb::Piece& p : rd->pieces) shapes[p.tensor()] = std::vector<int64_t>(p.box().end().begin(), p.box().end().end());

  // Trainers: sized as described, every local tensor filled through its view, piece by piece.
  std::vector<std::unique_ptr<WorkerClient>> trainers;
  for (uint32_t rank = 0; rank < 2; ++rank) {
    auto c = Connect();
    ASSERT_NE(c, nullptr);
    auto d = c->DescribeLayout(Megatron(rank), &model_);
    ASSERT_TRUE(d.ok()) << d.status();
    ASSERT_TRUE(c->RegisterWorker(model_, {absl::StrCat("trainer/", rank), planner::Role::kTrainer, -1}).ok());
    auto buf = c->CreateBuffer(d->BufferBytes(0));
    ASSERT_TRUE(buf.ok());
    auto info = c->RegisterLayout(Megatron(rank));
    ASSERT_TRUE(info.ok()) << info.status();
    // RegisterLayout answers the same description.
    ASSERT_EQ(info->layout.tensors.size(), d->tensors.size());
    for (size_t i = 0; i < d->tensors.size(); ++i) {
      EXPECT_EQ(info->layout.tensors[i].name, d->tensors[i].name);
      EXPECT_EQ(info->layout.tensors[i].offset_bytes, d->tensors[i].offset_bytes);
      EXPECT_EQ(info->layout.tensors[i].shape, d->tensors[i].shape);
    }
    EXPECT_EQ(info->layout.piece_bytes, info->bytes);
    EXPECT_EQ(info->layout.pieces.size(), info->num_pieces);
    for (const LocalTensorPlace& t : info->layout.tensors) {
      auto v = c->View(info->layout, t.name);
      ASSERT_TRUE(v.ok()) << v.status();
      ASSERT_EQ(v->data, static_cast<uint8_t*>((*buf)->data) + t.offset_bytes);
      for (uint32_t k : t.pieces) {
        const pb::Piece& p = info->layout.pieces[k];
        ASSERT_TRUE(shapes.count(p.tensor())) << p.tensor();
        uint8_t* base = v->data + (static_cast<int64_t>(p.offset_bytes()) - t.offset_bytes);
        const std::string& name = p.tensor();
        ForEachElement(p, shapes[name], [&](int64_t flat, int64_t off) {
          const uint16_t x = Value(name, flat);
          std::memcpy(base + off, &x, 2);
        });
      }
    }
    EXPECT_EQ(c->View(info->layout, "no.such.tensor").status().code(), absl::StatusCode::kNotFound);
    trainers.push_back(std::move(c));
  }

  // The rollout: registered as described; after version 1 its framework tensors, read by their
  // local shape alone (no pieces), hold the canonical values: the fused qkv_proj is [q; k; v].
  ASSERT_TRUE(ro->RegisterWorker(model_, {"rollout/0", planner::Role::kRollout, -1}).ok());
  ASSERT_TRUE(ro->CreateBuffer(rd->BufferBytes(0)).ok());
  auto rinfo = ro->RegisterLayout(vllm);
  ASSERT_TRUE(rinfo.ok()) << rinfo.status();
  for (auto& t : trainers) ASSERT_TRUE(t->Publish(1, absl::Seconds(30)).ok());
  auto applied = ro->Apply(1, absl::Seconds(30));
  ASSERT_TRUE(applied.ok()) << applied.status();
  auto read = [&](const std::string& local, int64_t row, int64_t col) {
    auto v = ro->View(rinfo->layout, local);
    EXPECT_TRUE(v.ok()) << v.status();
    if (!v.ok()) return uint16_t{0};
    const std::vector<int64_t>& st = v->tensor->strides;
    uint16_t x;
    std::memcpy(&x, v->data + (row * st[0] + (st.size() > 1 ? col * st[1] : 0)) * 2, 2);
    return x;
  };
  int64_t bad = 0;
  for (int64_t r = 0; r < 512; ++r) {
    const std::string src = r < 256 ? "q_proj" : r < 384 ? "k_proj" : "v_proj";
    const int64_t row = r < 256 ? r : r < 384 ? r - 256 : r - 384;
    for (int64_t col = 0; col < 256; ++col) {
      bad += read("model.layers.1.self_attn.qkv_proj.weight", r, col) != Value("model.layers.1.self_attn." + src + ".weight", row * 256 + col);
    }
    bad += read("model.layers.0.self_attn.qkv_proj.bias", r, 0) != Value("model.layers.0.self_attn." + src + ".bias", row);
  }
  for (int64_t r = 0; r < 4096; r += 7) {
    for (int64_t col = 0; col < 256; ++col) bad += read("model.embed_tokens.weight", r, col) != Value("model.embed_tokens.weight", r * 256 + col);
  }
  EXPECT_EQ(bad, 0);

  // wbctl layout over the worker socket: the node's answer for the registered model, the same
  // buffer size the client was told.
  std::ostringstream out, err;
  ASSERT_EQ(RunLayoutCommand({"--addr", "unix:" + socket_, "--model", "m", "--preset", "megatron", "--tp", "2", "--rank", "0"}, out, err), 0)
      << err.str();
  EXPECT_THAT(out.str(), HasSubstr(absl::StrCat("buffer 0: ", size, " bytes")));
  EXPECT_THAT(out.str(), HasSubstr("decoder.layers.1.self_attention.linear_qkv.weight"));
  std::ostringstream out2, err2;
  EXPECT_EQ(RunLayoutCommand({"--addr", "unix:" + socket_, "--model", "unknown", "--preset", "vllm"}, out2, err2), 1);
  EXPECT_THAT(err2.str(), HasSubstr("NOT_FOUND"));
}

}  // namespace
}  // namespace wb::client
