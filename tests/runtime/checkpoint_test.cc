#include "pipewright/checkpoint.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/sha256.h"
#include "tests/test_util.h"

namespace pipewright {
namespace {

namespace fs = std::filesystem;

// A fresh, empty directory per test, removed afterwards.
class CheckpointTest : public testing_util::ScratchDirTest {};

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string U64Le(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  return s;
}

uint64_t ReadU64Le(const std::string& s) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(s[i])) << (8 * i);
  return v;
}

// Builds a raw safetensors file from a header text and data bytes.
std::string MakeFile(const std::string& header, const std::string& data) {
  return U64Le(header.size()) + header + data;
}

Tensor Bf16(std::vector<int64_t> shape, const std::vector<uint16_t>& bits) {
  Tensor t = Tensor::Empty(std::move(shape), DType::kBF16);
  EXPECT_EQ(static_cast<size_t>(t.numel()), bits.size());
  std::memcpy(t.raw(), bits.data(), t.nbytes());
  return t;
}

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0);
}

NamedTensors SampleTensors() {
  return {
      {"blocks.0.attn.qkv.weight",
       Tensor::FromVector({2, 3}, {1.5f, -2.0f, 3.25f, 0.0f, -0.0f, 1e-30f})},
      {"tokens", Tensor::FromVectorI32({4}, {1, -2, 2147483647, -2147483647 - 1})},
      {"alpha.bf16", Bf16({3}, {0x3F80, 0xBF80, 0x7FC0})},
      {"empty", Tensor::FromVector({0, 5}, {})},
  };
}

TEST_F(CheckpointTest, SafetensorsRoundTripIsByteExact) {
  NamedTensors tensors = SampleTensors();
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "42"}};
  ASSERT_TRUE(WriteSafetensors(Path("a.safetensors"), tensors, meta).ok());

  auto file = ReadSafetensors(Path("a.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata, meta);
  ASSERT_EQ(file->tensors.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    auto it = file->tensors.find(name);
    ASSERT_NE(it, file->tensors.end()) << name;
    EXPECT_TRUE(SameBytes(t, it->second)) << name;
  }
}

TEST_F(CheckpointTest, WrittenFileFollowsTheSpec) {
  NamedTensors tensors = SampleTensors();
  ASSERT_TRUE(WriteSafetensors(Path("a.safetensors"), tensors, {{"k", "v"}}).ok());
  const std::string bytes = ReadBytes(Path("a.safetensors"));
  ASSERT_GE(bytes.size(), 8u);
  const uint64_t n = ReadU64Le(bytes);
  ASSERT_LE(n, bytes.size() - 8);
  EXPECT_EQ((8 + n) % 8, 0u) << "header is padded to a multiple of 8";

  const std::string header_text = bytes.substr(8, n);
  nlohmann::json header = nlohmann::json::parse(header_text, nullptr, false);
  ASSERT_FALSE(header.is_discarded()) << header_text;
  ASSERT_TRUE(header.is_object());
  EXPECT_EQ(header["__metadata__"]["k"], "v");

  // Tensors are laid out in the given order, contiguously from offset 0.
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(header.contains(name)) << name;
    const auto& e = header[name];
    EXPECT_EQ(e["dtype"].get<std::string>(), DTypeSafetensorsName(t.dtype())) << name;
    EXPECT_EQ(e["shape"].get<std::vector<int64_t>>(), t.shape()) << name;
    const auto offsets = e["data_offsets"].get<std::vector<uint64_t>>();
    ASSERT_EQ(offsets.size(), 2u);
    EXPECT_EQ(offsets[0], offset) << name;
    EXPECT_EQ(offsets[1], offset + t.nbytes()) << name;
    if (t.nbytes() > 0) {
      EXPECT_EQ(std::memcmp(bytes.data() + 8 + n + offsets[0], t.raw(), t.nbytes()), 0) << name;
    }
    offset += t.nbytes();
  }
  EXPECT_EQ(8 + n + offset, bytes.size());
  EXPECT_EQ(header["blocks.0.attn.qkv.weight"]["dtype"], "F32");
  EXPECT_EQ(header["tokens"]["dtype"], "I32");
  EXPECT_EQ(header["alpha.bf16"]["dtype"], "BF16");
}

TEST_F(CheckpointTest, ReadsHandWrittenFile) {
  std::string data(8, '\0');
  float v[2] = {1.0f, 2.0f};
  std::memcpy(data.data(), v, 8);
  WriteBytes(Path("h.safetensors"),
             MakeFile(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}   )", data));
  auto file = ReadSafetensors(Path("h.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->tensors.count("x"), 1u);
  EXPECT_EQ(file->tensors["x"].ToVector(), (std::vector<float>{1.0f, 2.0f}));
}

TEST_F(CheckpointTest, RejectsBadTensorsOnWrite) {
  EXPECT_FALSE(WriteSafetensors(Path("e.safetensors"), {{"", Tensor::FromVector({1}, {1})}}).ok());
  EXPECT_FALSE(WriteSafetensors(Path("d.safetensors"), {{"a", Tensor::FromVector({1}, {1})},
                                                        {"a", Tensor::FromVector({1}, {2})}})
                   .ok());
}

TEST_F(CheckpointTest, TruncatedFileIsAnError) {
  ASSERT_TRUE(WriteSafetensors(Path("a.safetensors"), SampleTensors()).ok());
  const std::string bytes = ReadBytes(Path("a.safetensors"));
  // Every truncation point: inside the length, inside the header, inside the data.
  for (size_t len : {size_t{0}, size_t{3}, size_t{7}, size_t{8}, size_t{20}, bytes.size() / 2,
                     bytes.size() - 1}) {
    WriteBytes(Path("t.safetensors"), bytes.substr(0, len));
    auto file = ReadSafetensors(Path("t.safetensors"));
    EXPECT_FALSE(file.ok()) << "truncated to " << len;
  }
}

TEST_F(CheckpointTest, HugeHeaderLengthIsAnError) {
  ASSERT_TRUE(WriteSafetensors(Path("a.safetensors"), SampleTensors()).ok());
  std::string bytes = ReadBytes(Path("a.safetensors"));
  for (uint64_t n : {~uint64_t{0}, uint64_t{1} << 40, uint64_t{200} * 1000 * 1000,
                     static_cast<uint64_t>(bytes.size())}) {
    std::string bad = U64Le(n) + bytes.substr(8);
    WriteBytes(Path("b.safetensors"), bad);
    auto file = ReadSafetensors(Path("b.safetensors"));
    EXPECT_FALSE(file.ok()) << "header length " << n;
  }
}

TEST_F(CheckpointTest, MalformedJsonHeaderIsAnError) {
  const std::string data(8, '\0');
  for (const std::string& header : {
           std::string(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})"),  // unclosed
           std::string("not json at all!"),
           std::string("[1, 2, 3]"),
           std::string(R"({"x": 5})"),
           std::string(R"({"x":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}})"),
           std::string(R"({"x":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})"),
           std::string(R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})"),
           std::string(R"({"x":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})"),
           std::string(R"({"x":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})"),
           std::string(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0]}})"),
           std::string(R"({"x":{"dtype":"F32","shape":[2]}})"),
           std::string(R"({"__metadata__":{"k":1}})"),
           std::string(R"({"__metadata__":[]})"),
           std::string("{\"x\":\x01\xff}"),
           std::string(),
       }) {
    WriteBytes(Path("m.safetensors"), MakeFile(header, data));
    auto file = ReadSafetensors(Path("m.safetensors"));
    EXPECT_FALSE(file.ok()) << header;
  }
}

TEST_F(CheckpointTest, BadOffsetsAreAnError) {
  const std::string data(16, '\0');
  for (const std::string& header : {
           // out of range
           std::string(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})"),
           std::string(
               R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,18446744073709551615]}})"),
           // begin > end
           std::string(R"({"x":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})"),
           // size does not match shape x dtype
           std::string(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})"),
           std::string(R"({"x":{"dtype":"BF16","shape":[4],"data_offsets":[0,16]}})"),
           // overlapping
           std::string(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},)"
                       R"("y":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})"),
           // gap at the start / trailing bytes not covered
           std::string(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})"),
           std::string(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})"),
           // negative offset
           std::string(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[-8,8]}})"),
           // shape overflow
           std::string(R"({"x":{"dtype":"F32","shape":[4294967296,4294967296,16],)"
                       R"("data_offsets":[0,16]}})"),
           std::string(R"({"x":{"dtype":"F32","shape":[4611686018427387904],)"
                       R"("data_offsets":[0,16]}})"),
       }) {
    WriteBytes(Path("o.safetensors"), MakeFile(header, data));
    auto file = ReadSafetensors(Path("o.safetensors"));
    EXPECT_FALSE(file.ok()) << header;
  }
}

TEST_F(CheckpointTest, MissingFileIsNotFound) {
  auto file = ReadSafetensors(Path("nope.safetensors"));
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CheckpointTest, CheckpointRoundTrip) {
  const std::string dir = Path("ckpt");
  const std::string manifest = R"({"format": "pipewright.checkpoint/v1", "step": 7})";
  NamedTensors model = SampleTensors();
  NamedTensors opt = {{"exp_avg.w", Tensor::FromVector({2}, {0.5f, 0.25f})},
                      {"exp_avg_sq.w", Tensor::FromVector({2}, {1.0f, 4.0f})}};
  absl::Status s = WriteCheckpoint(dir, manifest, model, opt);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(fs::exists(dir + "/manifest.json"));
  EXPECT_TRUE(fs::exists(dir + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/optimizer.safetensors"));

  auto ckpt = ReadCheckpoint(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  // The manifest as given, plus each tensor file's size and SHA-256 (Note [Checkpoint digests]).
  nlohmann::json m = nlohmann::json::parse(ckpt->manifest_json);
  EXPECT_EQ(m["format"], "pipewright.checkpoint/v1");
  EXPECT_EQ(m["step"], 7);
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    ASSERT_TRUE(m["files"].contains(f)) << m.dump();
    EXPECT_EQ(m["files"][f]["bytes"].get<uint64_t>(), fs::file_size(dir + "/" + f));
    EXPECT_EQ(m["files"][f]["sha256"], Sha256Hex(ReadBytes(dir + "/" + f)));
  }
  EXPECT_EQ(ReadBytes(dir + "/manifest.json.sha256"),
            Sha256Hex(ReadBytes(dir + "/manifest.json")) + "  manifest.json\n");
  EXPECT_EQ(ckpt->path, dir);
  EXPECT_TRUE(ckpt->warnings.empty());
  ASSERT_EQ(ckpt->model.size(), model.size());
  for (const auto& [name, t] : model) EXPECT_TRUE(SameBytes(t, ckpt->model.at(name))) << name;
  ASSERT_EQ(ckpt->optimizer.size(), opt.size());
  for (const auto& [name, t] : opt) EXPECT_TRUE(SameBytes(t, ckpt->optimizer.at(name))) << name;
}

TEST_F(CheckpointTest, MissingOptimizerFileGivesEmptyMap) {
  const std::string dir = Path("ckpt");
  ASSERT_TRUE(
      WriteCheckpoint(dir, "{}", SampleTensors(), {{"m", Tensor::FromVector({1}, {1})}}).ok());
  fs::remove(dir + "/optimizer.safetensors");
  // The manifest lists the file: its absence is damage, named.
  auto damaged = ReadCheckpoint(dir);
  EXPECT_EQ(damaged.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(damaged.status().message().find("optimizer.safetensors: listed in the manifest"),
            std::string::npos)
      << damaged.status();
  // A checkpoint from before digests (no "files", no manifest.json.sha256) is read as it is.
  WriteBytes(dir + "/manifest.json", "{}");
  fs::remove(dir + "/manifest.json.sha256");
  auto ckpt = ReadCheckpoint(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE(ckpt->optimizer.empty());
  EXPECT_EQ(ckpt->model.size(), SampleTensors().size());
}

TEST_F(CheckpointTest, OverwriteReplacesFullyAndLeavesNoSiblings) {
  const std::string dir = Path("ckpt");
  ASSERT_TRUE(WriteCheckpoint(dir, R"({"step": 1})", SampleTensors(),
                              {{"exp_avg.a", Tensor::FromVector({1}, {1})}})
                  .ok());
  // A stray file in the old checkpoint must not survive the overwrite.
  WriteBytes(dir + "/stray.txt", "old");

  NamedTensors model2 = {{"only", Tensor::FromVector({2}, {9.0f, 8.0f})}};
  absl::Status s = WriteCheckpoint(dir, R"({"step": 2})", model2, {});
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_FALSE(fs::exists(dir + "/stray.txt"));

  auto ckpt = ReadCheckpoint(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(nlohmann::json::parse(ckpt->manifest_json)["step"], 2);
  ASSERT_EQ(ckpt->model.size(), 1u);
  EXPECT_EQ(ckpt->model.at("only").ToVector(), (std::vector<float>{9.0f, 8.0f}));
  EXPECT_TRUE(ckpt->optimizer.empty());

  std::vector<std::string> entries;
  for (const auto& e : fs::directory_iterator(root_)) entries.push_back(e.path().filename());
  EXPECT_EQ(entries, std::vector<std::string>{"ckpt"});
}

TEST_F(CheckpointTest, TrailingSlashNamesTheSameDirectory) {
  ASSERT_TRUE(WriteCheckpoint(Path("ckpt") + "/", "{}", SampleTensors(), {}).ok());
  std::vector<std::string> entries;
  for (const auto& e : fs::directory_iterator(root_)) entries.push_back(e.path().filename());
  EXPECT_EQ(entries, std::vector<std::string>{"ckpt"});
  EXPECT_TRUE(ReadCheckpoint(Path("ckpt")).ok());
}

TEST_F(CheckpointTest, WriteFailureReturnsErrorAndCleansUp) {
  // The parent "directory" is a regular file, so nothing can be created under it.
  WriteBytes(Path("file"), "x");
  absl::Status s = WriteCheckpoint(Path("file") + "/ckpt", "{}", SampleTensors(), {});
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find(Path("file")), absl::string_view::npos) << s;

  // A bad tensor fails the write after the temp dir exists; it must be removed.
  s = WriteCheckpoint(Path("ckpt"), "{}", {{"", Tensor::FromVector({1}, {1})}}, {});
  EXPECT_FALSE(s.ok());
  std::vector<std::string> entries;
  for (const auto& e : fs::directory_iterator(root_)) entries.push_back(e.path().filename());
  EXPECT_EQ(entries, std::vector<std::string>{"file"});
}

TEST_F(CheckpointTest, DiskFullIsAnErrorNamingThePath) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  absl::Status s = WriteSafetensors("/dev/full", SampleTensors());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("/dev/full"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find(std::strerror(ENOSPC)), absl::string_view::npos) << s;
}

TEST_F(CheckpointTest, ReadMissingCheckpointIsNotFound) {
  EXPECT_EQ(ReadCheckpoint(Path("does_not_exist")).status().code(), absl::StatusCode::kNotFound);
  fs::create_directories(Path("no_manifest"));
  EXPECT_EQ(ReadCheckpoint(Path("no_manifest")).status().code(), absl::StatusCode::kNotFound);
}

// ---- SHA-256 (FIPS 180-4 test vectors) ----

TEST(Sha256, MatchesTheStandardsVectors) {
  EXPECT_EQ(Sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Sha256Hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(Sha256Hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, PiecesGiveTheSameDigestAsTheWhole) {
  std::string data;
  for (int i = 0; i < 1000; ++i) data.push_back(static_cast<char>(i * 31 % 251));
  for (size_t piece : {1u, 3u, 63u, 64u, 65u, 200u}) {
    Sha256 h;
    for (size_t i = 0; i < data.size(); i += piece) {
      h.Update(data.data() + i, std::min(piece, data.size() - i));
    }
    EXPECT_EQ(h.HexDigest(), Sha256Hex(data)) << "pieces of " << piece;
  }
}

// ---- checkpoint directories ----

absl::Status SaveSample(const std::string& dir, int64_t step, int keep) {
  return SaveCheckpointStep(dir, step, keep, [&](const std::string& path) {
    const std::string manifest = "{\"step\": " + std::to_string(step) + "}";
    return WriteCheckpoint(path, manifest, SampleTensors(),
                           {{"m", Tensor::FromVector({1}, {static_cast<float>(step)})}});
  });
}

int64_t StepRead(const absl::StatusOr<Checkpoint>& ck) {
  return nlohmann::json::parse(ck->manifest_json)["step"].get<int64_t>();
}

TEST_F(CheckpointTest, StepCheckpointsKeepTheNewestAndPointAtTheLast) {
  const std::string dir = Path("run");
  for (int64_t step : {2, 4, 6, 8}) ASSERT_TRUE(SaveSample(dir, step, 2).ok());
  std::vector<std::string> entries;
  for (const auto& e : fs::directory_iterator(dir)) entries.push_back(e.path().filename());
  std::sort(entries.begin(), entries.end());
  EXPECT_EQ(entries, (std::vector<std::string>{"latest", "step-000006", "step-000008"}));
  EXPECT_EQ(ReadBytes(dir + "/latest"), "step-000008\n");
  auto ck = ReadCheckpoint(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ(StepRead(ck), 8);
  EXPECT_EQ(ck->path, dir + "/step-000008");
  EXPECT_EQ(*ResolveCheckpointDir(dir), dir + "/step-000008");
  EXPECT_EQ(StepCheckpointName(1234567), "step-1234567");
  // A single checkpoint is not a checkpoint directory to add steps to.
  ASSERT_TRUE(WriteCheckpoint(Path("single"), "{}", SampleTensors(), {}).ok());
  EXPECT_EQ(SaveSample(Path("single"), 1, 0).code(), absl::StatusCode::kFailedPrecondition);
}

// Any one flipped byte in the newest checkpoint is found, named, and the previous checkpoint is
// used instead; with every checkpoint damaged, reading fails with each reason.
TEST_F(CheckpointTest, AFlippedByteInAnyFileFallsBackToThePreviousCheckpoint) {
  for (const char* file :
       {"manifest.json", "manifest.json.sha256", "model.safetensors", "optimizer.safetensors"}) {
    const std::string dir = Path(std::string("flip_") + file);
    ASSERT_TRUE(SaveSample(dir, 3, 0).ok());
    ASSERT_TRUE(SaveSample(dir, 5, 0).ok());
    const std::string path = dir + "/step-000005/" + file;
    std::string bytes = ReadBytes(path);
    for (size_t at : {size_t{0}, bytes.size() / 2, bytes.size() - 1}) {
      std::string damaged = bytes;
      damaged[at] = static_cast<char>(damaged[at] ^ 0x04);
      WriteBytes(path, damaged);
      auto ck = ReadCheckpoint(dir);
      ASSERT_TRUE(ck.ok()) << file << " byte " << at << ": " << ck.status();
      EXPECT_EQ(StepRead(ck), 3) << file << " byte " << at;
      ASSERT_EQ(ck->warnings.size(), 1u) << file;
      const std::string named =
          std::string(file) == "manifest.json.sha256" ? "manifest.json" : file;
      EXPECT_NE(ck->warnings[0].find(dir + "/step-000005/" + named), std::string::npos)
          << ck->warnings[0];
      if (std::string(file).find("safetensors") != std::string::npos) {
        EXPECT_NE(ck->warnings[0].find(path + ": SHA-256 mismatch"), std::string::npos)
            << ck->warnings[0];
      }
    }
    WriteBytes(path, bytes);
    EXPECT_EQ(StepRead(ReadCheckpoint(dir)), 5) << "restored";
  }
  const std::string dir = Path("all_bad");
  ASSERT_TRUE(SaveSample(dir, 1, 0).ok());
  WriteBytes(dir + "/step-000001/model.safetensors", "garbage");
  auto ck = ReadCheckpoint(dir);
  EXPECT_EQ(ck.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(ck.status().message().find("model.safetensors"), std::string::npos) << ck.status();
}

TEST_F(CheckpointTest, DebrisOfInterruptedSavesIsRemoved) {
  const std::string dir = Path("run");
  ASSERT_TRUE(SaveSample(dir, 1, 0).ok());
  for (const std::string& junk : {dir + "/step-000002.tmp-123-0", dir + "/step-000001.old-77",
                                  Path("run.tmp-9-1"), Path("run.old-9")}) {
    fs::create_directories(junk);
    WriteBytes(junk + "/model.safetensors", "partial");
  }
  WriteBytes(dir + "/latest.tmp-55", "step-000002\n");
  WriteBytes(dir + "/notes.txt", "mine");  // not debris: left alone
  auto report = RecoverInterruptedSaves(dir);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->removed.size(), 5u);
  EXPECT_TRUE(report->restored.empty());
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(root_)) left.push_back(e.path().filename());
  for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"latest", "notes.txt", "run", "step-000001"}));
  EXPECT_EQ(StepRead(ReadCheckpoint(dir)), 1);
}

}  // namespace
}  // namespace pipewright
