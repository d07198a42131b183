// The ecosystem's token files (runtime/token_formats.cc, Note [Token streams]): Megatron indexed
// datasets, llm.c shards and nanoGPT's headerless files, written here byte by byte (no numpy),
// read as one stream whose windows are the text dataset's for the same tokens; and every way a
// file can be wrong, refused by name.
#include <sys/stat.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "pipewright/data.h"
#include "tests/test_util.h"

namespace pipewright {
namespace {

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A Megatron index over `lengths` sequences at `pointers` (bytes) with dtype `code`.
std::string MegatronIndex(const std::vector<int32_t>& lengths, const std::vector<int64_t>& pointers,
                          uint8_t code, uint64_t version = 1) {
  std::string s("MMIDIDX\0\0", 9);
  Put<uint64_t>(&s, version);
  Put<uint8_t>(&s, code);
  Put<uint64_t>(&s, lengths.size());
  Put<uint64_t>(&s, lengths.size() + 1);  // one document per sequence
  for (int32_t n : lengths) Put(&s, n);
  for (int64_t p : pointers) Put(&s, p);
  for (size_t d = 0; d <= lengths.size(); ++d) Put<int64_t>(&s, static_cast<int64_t>(d));
  return s;
}

// An llm.c shard of `tokens` (version 1: uint16, 2: uint32).
std::string Shard(const std::vector<uint32_t>& tokens, int32_t version = 1, int32_t count = -1) {
  std::string s;
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = version;
  header[2] = count >= 0 ? count : static_cast<int32_t>(tokens.size());
  for (int32_t h : header) Put(&s, h);
  for (uint32_t t : tokens) {
    if (version == 1) {
      Put<uint16_t>(&s, static_cast<uint16_t>(t));
    } else {
      Put<uint32_t>(&s, t);
    }
  }
  return s;
}

std::vector<uint32_t> Text(const std::string& text) { return {text.begin(), text.end()}; }

class TokenFormatsTest : public testing_util::ScratchDirTest {
 protected:
  // Every sample of `got` equals the text dataset's over `text` (same seed, same windows).
  void ExpectTextSamples(const TokenDataset& got, const std::string& text, int64_t T) {
    WriteFile(Path("same.txt"), text);
    auto want = OpenTextDataset(Path("same.txt"), T, 9);
    ASSERT_TRUE(want.ok()) << want.status();
    for (int64_t i = 0; i < 50; ++i) {
      std::vector<int32_t> a(T + 1), b(T + 1);
      got.Tokens(i, T, a.data());
      (*want)->Tokens(i, T, b.data());
      ASSERT_EQ(a, b) << "sample " << i << " of " << got.Describe();
    }
  }
  const std::string text_ =
      "First Citizen: Before we proceed any further, hear me speak. All: "
      "Speak, speak. First Citizen: You are all resolved rather to die?";
};

// Megatron: sequences stored out of order (the index's pointers say where), in each integer dtype;
// the prefix, the .bin and the .idx all name it.
TEST_F(TokenFormatsTest, MegatronSequencesAreOneStreamInIndexOrder) {
  const std::string a = text_.substr(0, 50), b = text_.substr(50, 30), c = text_.substr(80);
  struct Dtype {
    uint8_t code;
    int width;
  };
  for (const Dtype d : {Dtype{1, 1}, Dtype{8, 2}, Dtype{3, 2}, Dtype{4, 4}, Dtype{5, 8}}) {
    // .bin holds c, a, b; the index lists a, b, c.
    std::string bin;
    auto put = [&](const std::string& s) {
      for (unsigned char ch : s) {
        const int64_t v = ch;
        bin.append(reinterpret_cast<const char*>(&v), d.width);  // little-endian low bytes
      }
    };
    put(c);
    put(a);
    put(b);
    const int64_t w = d.width;
    WriteFile(Path("m.bin"), bin);
    WriteFile(Path("m.idx"),
              MegatronIndex({static_cast<int32_t>(a.size()), static_cast<int32_t>(b.size()),
                             static_cast<int32_t>(c.size())},
                            {static_cast<int64_t>(c.size()) * w,
                             static_cast<int64_t>(c.size() + a.size()) * w, 0},
                            d.code));
    for (const std::string spec : {Path("m"), Path("m.bin"), Path("m.idx")}) {
      auto ds = OpenDataset(spec, 16, 9);
      ASSERT_TRUE(ds.ok()) << ds.status();
      EXPECT_EQ((*ds)->vocab_size(),
                1 + static_cast<unsigned char>(*std::max_element(text_.begin(), text_.end())));
      EXPECT_NE((*ds)->Describe().find("megatron:"), std::string::npos) << (*ds)->Describe();
      ExpectTextSamples(**ds, text_, 16);
    }
  }
}

// llm.c shards: one, or several by a glob (sorted), as one stream; uint32 (version 2) too; and
// nanoGPT's headerless uint16 file by its prefix.
TEST_F(TokenFormatsTest, LlmcShardsAndNanoGptFiles) {
  WriteFile(Path("train_000001.bin"), Shard(Text(text_.substr(0, 70))));
  WriteFile(Path("train_000002.bin"), Shard(Text(text_.substr(70))));
  auto two = OpenDataset(Path("train_*.bin"), 16, 9);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_NE((*two)->Describe().find("from 2 files"), std::string::npos) << (*two)->Describe();
  ExpectTextSamples(**two, text_, 16);
  WriteFile(Path("wide.bin"), Shard(Text(text_), 2));
  auto wide = OpenDataset(Path("wide.bin"), 16, 9);
  ASSERT_TRUE(wide.ok()) << wide.status();
  EXPECT_NE((*wide)->Describe().find("uint32"), std::string::npos);
  ExpectTextSamples(**wide, text_, 16);
  std::string raw;
  for (unsigned char ch : text_) Put<uint16_t>(&raw, ch);
  WriteFile(Path("nano.bin"), raw);
  auto nano = OpenDataset("nanogpt:" + Path("nano.bin"), 16, 9);
  ASSERT_TRUE(nano.ok()) << nano.status();
  ExpectTextSamples(**nano, text_, 16);
  // Large ids count in the vocabulary, which the byte-level presets refuse by name.
  std::vector<uint32_t> big = Text(text_);
  big[5] = 50256;
  WriteFile(Path("gpt2.bin"), Shard(big));
  auto g = OpenDataset(Path("gpt2.bin"), 16, 9);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ((*g)->vocab_size(), 50257);
  absl::Status v = CheckVocabulary(**g, 256);
  EXPECT_FALSE(v.ok());
  EXPECT_NE(v.message().find("50257"), std::string::npos) << v;
}

// Every malformed file is an error naming the file and the problem; none crashes or hangs.
TEST_F(TokenFormatsTest, MalformedFilesAreRefusedByName) {
  auto expect = [&](const std::string& spec, const std::string& what, const std::string& file) {
    auto ds = OpenDataset(spec, 16, 9);
    ASSERT_FALSE(ds.ok()) << spec;
    EXPECT_NE(ds.status().message().find(what), std::string::npos) << ds.status();
    EXPECT_NE(ds.status().message().find(file), std::string::npos) << ds.status();
  };
  const std::string bin(text_.begin(), text_.end());
  WriteFile(Path("m.bin"), bin);
  const int32_t n = static_cast<int32_t>(bin.size());
  WriteFile(Path("m.idx"), "MMIDIDY" + MegatronIndex({n}, {0}, 1).substr(7));
  expect(Path("m"), "magic", "m.idx");
  WriteFile(Path("m.idx"), MegatronIndex({n}, {0}, 1, /*version=*/2));
  expect(Path("m"), "version 2", "m.idx");
  WriteFile(Path("m.idx"), MegatronIndex({n}, {0}, 7));
  expect(Path("m"), "float32", "m.idx");
  WriteFile(Path("m.idx"), MegatronIndex({n}, {0}, 9));
  expect(Path("m"), "unknown dtype code 9", "m.idx");
  WriteFile(Path("m.idx"), MegatronIndex({n + 1}, {0}, 1));
  expect(Path("m.bin"), "outside", "m.bin");
  WriteFile(Path("m.idx"), MegatronIndex({n}, {-8}, 1));
  expect(Path("m.bin"), "outside", "m.bin");
  const std::string idx = MegatronIndex({n}, {0}, 1);
  WriteFile(Path("m.idx"), idx.substr(0, idx.size() - 3));
  expect(Path("m.idx"), "bytes", "m.idx");
  WriteFile(Path("m.idx"), idx.substr(0, 20));
  expect(Path("m.idx"), "truncated", "m.idx");
  // Counts near 2^64 are bounded by the file before any product.
  std::string huge = idx;
  const uint64_t big = ~uint64_t{0} / 4;
  std::memcpy(&huge[18], &big, 8);
  WriteFile(Path("m.idx"), huge);
  expect(Path("m.idx"), "sequences", "m.idx");
  WriteFile(Path("m.idx"), idx);
  WriteFile(Path("m.bin"), bin.substr(0, 10));
  expect(Path("m"), "outside", "m.bin");
  // llm.c: magic, version, a count the size does not match (short and long), too few tokens.
  WriteFile(Path("s.bin"), Shard(Text(text_), 3));
  expect(Path("s.bin"), "version 3", "s.bin");
  WriteFile(Path("s.bin"), Shard(Text(text_), 1, n + 5));
  expect(Path("s.bin"), "truncated", "s.bin");
  WriteFile(Path("s.bin"), Shard(Text(text_), 1, n - 5));
  expect(Path("s.bin"), "the file has", "s.bin");
  WriteFile(Path("s.bin"), Shard(Text("short"), 1));
  expect(Path("s.bin"), "a sample needs", "s.bin");
  WriteFile(Path("s.bin"), Shard(Text(text_), 1).substr(0, 100));
  expect(Path("s.bin"), "header", "s.bin");
  WriteFile(Path("u1.bin"), Shard(Text(text_), 1));
  WriteFile(Path("u2.bin"), Shard(Text(text_), 2));
  expect(Path("u?.bin"), "must agree", "u2.bin");
  expect(Path("none_*.bin"), "no data file matches", "none_");
  // A negative int32 token; a .bin that is no known format; an odd-sized nanoGPT file.
  std::string neg;
  for (int32_t t : {5, -3, 7}) Put(&neg, t);
  for (int i = 0; i < 40; ++i) Put<int32_t>(&neg, 65);
  WriteFile(Path("neg.bin"), neg);
  WriteFile(Path("neg.idx"), MegatronIndex({43}, {0}, 4));
  expect(Path("neg"), "token 1 of the stream is -3", "neg.bin");
  WriteFile(Path("plain.bin"), text_);
  expect(Path("plain.bin"), "neither a Megatron dataset", "plain.bin");
  WriteFile(Path("odd.bin"), text_.substr(0, 41));
  expect("nanogpt:" + Path("odd.bin"), "whole number", "odd.bin");
  // A FIFO where the .bin should be is refused without blocking.
  WriteFile(Path("m.bin"), bin);
  std::filesystem::remove(Path("m.bin"));
  ASSERT_EQ(::mkfifo(Path("m.bin").c_str(), 0600), 0);
  WriteFile(Path("m.idx"), idx);
  auto fifo = OpenDataset(Path("m"), 16, 9);
  EXPECT_FALSE(fifo.ok());
}

}  // namespace
}  // namespace pipewright
