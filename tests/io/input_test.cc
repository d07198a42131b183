// Bounded input (pipewright/input.h): special files are refused without blocking, sizes are
// checked before reading, JSON nesting is bounded.
#include "pipewright/input.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

namespace pipewright {
namespace {

namespace fs = std::filesystem;

class InputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("pw_input_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(InputTest, RegularFilesAreReadWhole) {
  std::ofstream(Path("a.json")) << "{\"x\": 1}";
  absl::StatusOr<std::string> text = ReadRegularFile(Path("a.json"), "--plan", 100);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "{\"x\": 1}");
  // Through a symbolic link to a regular file, too.
  fs::create_symlink(Path("a.json"), Path("link.json"));
  EXPECT_TRUE(ReadRegularFile(Path("link.json"), "--plan", 100).ok());
  // A regular file whose size says 0 (procfs) is read to its end, within the limit.
  absl::StatusOr<std::string> status = ReadRegularFile("/proc/self/status", "status", 1 << 20);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_NE(status->find("Pid:"), std::string::npos);
  EXPECT_FALSE(ReadRegularFile("/proc/self/status", "status", 16).ok());
}

TEST_F(InputTest, AFifoIsRefusedWithoutBlocking) {
  ASSERT_EQ(::mkfifo(Path("fifo").c_str(), 0644), 0);
  absl::StatusOr<std::string> r = ReadRegularFile(Path("fifo"), "--plan", 100);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "--plan '" + Path("fifo") + "' is a FIFO, not a regular file");
  // A link to a FIFO is the FIFO.
  fs::create_symlink(Path("fifo"), Path("link"));
  EXPECT_FALSE(RegularFile::Open(Path("link"), "x").ok());
}

TEST_F(InputTest, DevicesDirectoriesAndSocketsAreRefused) {
  for (const char* dev : {"/dev/zero", "/dev/null", "/dev/urandom"}) {
    absl::StatusOr<std::string> r = ReadRegularFile(dev, "manifest", 1 << 20);
    ASSERT_FALSE(r.ok()) << dev;
    EXPECT_NE(r.status().message().find("is a character device"), std::string::npos) << r.status();
  }
  fs::create_symlink("/dev/zero", Path("zero"));
  EXPECT_FALSE(ReadRegularFile(Path("zero"), "manifest", 1 << 20).ok());
  absl::StatusOr<std::string> d = ReadRegularFile(dir_.string(), "--data", 100);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("is a directory"), std::string::npos) << d.status();
  int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(s, 0);
  sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  const std::string sock = Path("s");
  if (sock.size() < sizeof(addr.sun_path)) {
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", sock.c_str());
    ASSERT_EQ(::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    absl::StatusOr<std::string> r = ReadRegularFile(sock, "x", 100);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("is a socket"), std::string::npos) << r.status();
  }
  ::close(s);
  absl::StatusOr<std::string> missing = ReadRegularFile(Path("none"), "--plan", 100);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

// A 1 GiB sparse file is refused by its size before any of it is read.
TEST_F(InputTest, TheSizeIsCheckedBeforeReading) {
  int fd = ::open(Path("big").c_str(), O_CREAT | O_WRONLY, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, int64_t{1} << 30), 0);
  ::close(fd);
  absl::StatusOr<std::string> r = ReadRegularFile(Path("big"), "checkpoint pointer", 4096);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "checkpoint pointer '" + Path("big") +
                                      "' is 1073741824 bytes; a checkpoint pointer is at most "
                                      "4096");
  std::ofstream(Path("exact")) << std::string(4096, 'x');
  EXPECT_TRUE(ReadRegularFile(Path("exact"), "x", 4096).ok());
  EXPECT_FALSE(ReadRegularFile(Path("exact"), "x", 4095).ok());
}

TEST(CheckJsonNesting, BoundsDepthOutsideStrings) {
  std::string ok = std::string(64, '[') + std::string(64, ']');
  EXPECT_TRUE(CheckJsonNesting(ok, "plan").ok());
  std::string deep = std::string(65, '[') + std::string(65, ']');
  absl::Status s = CheckJsonNesting(deep, "plan");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message(), "plan: JSON nested deeper than 64 levels (at byte 64)");
  // Objects count as arrays do; brackets in strings, escaped quotes included, do not.
  std::string objects;
  for (int i = 0; i < 65; ++i) objects += "{\"a\":";
  EXPECT_FALSE(CheckJsonNesting(objects, "x").ok());
  EXPECT_TRUE(CheckJsonNesting("[\"[[[[\\\"[[[[\"]", "x", 1).ok());
  EXPECT_FALSE(CheckJsonNesting("[\"\\\\\"[]]", "x", 1).ok());  // the string ends at \\"
  // 100,000 levels: refused, in linear time, without recursion.
  EXPECT_FALSE(CheckJsonNesting(std::string(100000, '['), "x").ok());
}

TEST_F(InputTest, OutputPathsRefuseFifosAndDirectories) {
  EXPECT_TRUE(CheckOutputPath(Path("new.json"), "--trace").ok());
  std::ofstream(Path("old.json")) << "x";
  EXPECT_TRUE(CheckOutputPath(Path("old.json"), "--trace").ok());
  EXPECT_TRUE(CheckOutputPath("/dev/null", "--trace").ok());
  ASSERT_EQ(::mkfifo(Path("fifo").c_str(), 0644), 0);
  absl::Status s = CheckOutputPath(Path("fifo"), "--trace");
  EXPECT_EQ(s.message(), "cannot write --trace '" + Path("fifo") + "': it is a FIFO");
  EXPECT_FALSE(CheckOutputPath(dir_.string(), "-o").ok());
}

}  // namespace
}  // namespace pipewright
