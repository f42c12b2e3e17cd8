#include "common/model_config.h"

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

namespace shoal {
namespace {

TEST(ModelConfig, ParsesAllFields) {
  auto c = ParseModelConfig(R"({"name":"m","task":"embed","runtime":"null","max_seq_len":128,
    "dim":64,"pooling":"cls","normalize":false,"intra_op_threads":2,
    "tokenizer":{"lowercase":false},
    "batching":{"max_batch_tokens":4096,"max_batch_size":16,"max_wait_us":500}})", "/models/m");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->name, "m");
  EXPECT_EQ(c->runtime, "null");
  EXPECT_EQ(c->max_seq_len, 128);
  EXPECT_EQ(c->pooling, "cls");
  EXPECT_FALSE(c->normalize);
  EXPECT_FALSE(c->tokenizer.lowercase);
  EXPECT_FALSE(c->tokenizer.strip_accents);  // follows lowercase unless given
  EXPECT_EQ(c->batching.max_batch_tokens, 4096);
  EXPECT_EQ(c->batching.max_wait_us, 500);
  EXPECT_EQ(c->ModelPath(), "/models/m/model.pt");
  EXPECT_EQ(c->VocabPath(), "/models/m/vocab.txt");
}

TEST(ModelConfig, RejectsBadValues) {
  EXPECT_EQ(ParseModelConfig("{", "/d").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseModelConfig("[]", "/d").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseModelConfig(R"({"task":"embed"})", "/d").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseModelConfig(R"({"name":"m","pooling":"max"})", "/d").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseModelConfig(R"({"name":"m","runtime":"onnx"})", "/d").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseModelConfig(R"({"name":"m","max_seq_len":"long"})", "/d").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseModelConfig(R"({"name":"m","batching":{"max_batch_tokens":10}})", "/d").status().code(),
            StatusCode::kInvalidArgument);
}

// A value of the wrong type or range is an error that names its key; a
// number is never cut or wrapped to fit (4294967552 read as an int was 256).
TEST(ModelConfig, AWrongValueNamesItsKey) {
  const auto error = [](const std::string& doc) { return ParseModelConfig(doc, "/d").status().message(); };
  EXPECT_NE(error(R"({"name":"m","max_seq_len":"256"})").find("'max_seq_len' must be a whole number"),
            std::string::npos);
  EXPECT_NE(error(R"({"name":"m","max_seq_len":256.9})").find("'max_seq_len'"), std::string::npos);
  EXPECT_NE(error(R"({"name":"m","max_seq_len":4294967552})").find("'max_seq_len'"), std::string::npos);
  EXPECT_NE(error(R"({"name":"m","dim":1e300})").find("'dim'"), std::string::npos);
  EXPECT_NE(error(R"({"name":"m","normalize":1})").find("'normalize' must be true or false"), std::string::npos);
  EXPECT_NE(error(R"({"name":"m","labels":["a",2]})").find("'labels' must be an array of strings"),
            std::string::npos);
  EXPECT_NE(error(R"({"name":"m","batching":{"max_wait_us":-0.5}})").find("'batching.max_wait_us'"),
            std::string::npos);
  EXPECT_NE(error(R"({"name":"m","batching":[]})").find("'batching' must be an object"), std::string::npos);
  EXPECT_NE(error(R"({"name":"m","tokenizer":"wordpiece"})").find("'tokenizer' must be an object"),
            std::string::npos);
  EXPECT_NE(error(R"({"name":"m","runtime":"process","process":{"command":["x"],"env":{"A":1}}})")
                .find("'process.env.A' must be a string"),
            std::string::npos);
}

// A misspelled key is an error with the nearest known key, not a default
// taken unnoticed; a "process" runtime's own keys pass through to it.
TEST(ModelConfig, UnknownKeysAreErrorsExceptForAProcessRuntime) {
  const auto error = [](const std::string& doc) { return ParseModelConfig(doc, "/d").status().message(); };
  EXPECT_NE(error(R"({"name":"m","max_seq_length":512})")
                .find("unknown key 'max_seq_length' (did you mean 'max_seq_len'?)"),
            std::string::npos);
  EXPECT_NE(error(R"({"name":"m","max_batch_size":8})").find("unknown key 'max_batch_size'"), std::string::npos);
  EXPECT_NE(error(R"({"name":"m","batching":{"max_wait_ms":8}})")
                .find("unknown key 'batching.max_wait_ms' (did you mean 'batching.max_wait_us'?)"),
            std::string::npos);
  EXPECT_NE(error(R"({"name":"m","tokenizer":{"do_lower_case":true}})").find("unknown key 'tokenizer.do_lower_case'"),
            std::string::npos);
  auto process = ParseModelConfig(
      R"({"name":"m","runtime":"process","weights":"w.bin","process":{"command":["x"],"module":"m.py"}})", "/d");
  EXPECT_TRUE(process.ok()) << process.status().ToString();
}

// Beyond these a value is a mistake that exhausts memory or overflows a
// clock: a runtime timeout of "forever" timed every batch out at once.
TEST(ModelConfig, BoundsSizesAndTimes) {
  const auto code = [](const std::string& doc) { return ParseModelConfig(doc, "/d").status().code(); };
  EXPECT_EQ(code(R"({"name":"m","runtime":"null","dim":2000000000})"), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(R"({"name":"m","runtime":"null","dim":1048576})"), StatusCode::kOk);
  EXPECT_EQ(code(R"({"name":"m","batching":{"max_batch_size":100000}})"), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(R"({"name":"m","batching":{"max_wait_us":9000000000000000}})"), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(R"({"name":"m","runtime":"process","process":{"command":["x"],"request_timeout_ms":9223372036854775807}})"),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code(R"({"name":"m","runtime":"process","process":{"command":["x"],"request_timeout_ms":86400000}})"),
            StatusCode::kOk);
}

// A name fits a JetStream consumer name (255 bytes with "shoal_"), where
// bytes other than letters, digits, '_' and '-' take three; no control
// characters.
TEST(ModelConfig, BoundsTheName) {
  const auto code = [](const std::string& name) {
    return ParseModelConfig(R"({"runtime":"null","name":")" + name + "\"}", "/d").status().code();
  };
  EXPECT_EQ(code(std::string(249, 'a')), StatusCode::kOk);
  EXPECT_EQ(code(std::string(250, 'a')), StatusCode::kInvalidArgument);
  EXPECT_EQ(code("org/" + std::string(245, 'a')), StatusCode::kInvalidArgument);  // '/' takes three
  EXPECT_EQ(code("org/" + std::string(243, 'a')), StatusCode::kOk);
  std::string cjk;
  for (int i = 0; i < 28; ++i) cjk += "\u4e2d";  // 3 UTF-8 bytes, 9 in the queue form
  EXPECT_EQ(code(cjk), StatusCode::kInvalidArgument);
  EXPECT_EQ(code("bell\\u0007name"), StatusCode::kInvalidArgument);  // JSON's escape for BEL
  EXPECT_EQ(code("next\\u0085line"), StatusCode::kInvalidArgument);  // C1
  EXPECT_EQ(code("caf\\u00e9"), StatusCode::kOk);
}

TEST(ModelConfig, ProcessRuntimeGivesUpAfterMaxFailedStarts) {
  auto c = ParseModelConfig(R"({"name":"m","runtime":"process","dim":4,"process":{"command":["run"]}})", "/d");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->process.max_failed_starts, 5);
  c = ParseModelConfig(R"({"name":"m","runtime":"process","dim":4,
    "process":{"command":["run"],"max_failed_starts":0}})", "/d");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->process.max_failed_starts, 0);  // never give up
  EXPECT_EQ(ParseModelConfig(R"({"name":"m","runtime":"process","dim":4,
    "process":{"command":["run"],"max_failed_starts":-1}})", "/d").status().code(),
            StatusCode::kInvalidArgument);
}

// The worker sets its runtime's socket and model directory; a config's
// variable of that name (or one whose name holds '=') would set another.
TEST(ModelConfig, ProcessEnvNamesAreTheirOwnAndNotTheWorkers) {
  const auto parse = [](const std::string& env) {
    return ParseModelConfig(R"({"name":"m","runtime":"process","dim":4,"process":{"command":["run"],"env":)" +
                                env + "}}",
                            "/d");
  };
  EXPECT_TRUE(parse(R"({"PATH":"/opt/venv/bin:/usr/bin"})").ok());
  for (const char* bad : {R"({"SHOAL_RUNTIME_SOCKET":"/tmp/s"})", R"({"SHOAL_MODEL_DIR":"/x"})", R"({"A=B":"c"})",
                          R"({"":"c"})", "{\"A\\u0000B\":\"c\"}"}) {
    auto c = parse(bad);
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(c.status().message().find("process.env"), std::string::npos) << c.status().ToString();
  }
}

TEST(ModelConfig, ScoreAndClassifyTasksDefaultTheirActivation) {
  auto score = ParseModelConfig(R"({"name":"r","task":"score","runtime":"null"})", "/d");
  ASSERT_TRUE(score.ok()) << score.status().ToString();
  EXPECT_TRUE(score->TakesPairs());
  EXPECT_EQ(score->EffectiveActivation(), "sigmoid");
  auto cls = ParseModelConfig(R"({"name":"c","task":"classify","runtime":"null",
    "labels":["neg","neu","pos"]})", "/d");
  ASSERT_TRUE(cls.ok()) << cls.status().ToString();
  EXPECT_FALSE(cls->TakesPairs());
  EXPECT_EQ(cls->dim, 3);  // from the labels
  EXPECT_EQ(cls->EffectiveActivation(), "softmax");
  auto raw = ParseModelConfig(R"({"name":"c","task":"classify","runtime":"null","activation":"none"})", "/d");
  ASSERT_TRUE(raw.ok());
  EXPECT_EQ(raw->EffectiveActivation(), "none");
  auto embed = ParseModelConfig(R"({"name":"e","runtime":"null"})", "/d");
  ASSERT_TRUE(embed.ok());
  EXPECT_EQ(embed->EffectiveActivation(), "none");
  EXPECT_NE(ModelConfigToJson(*cls).find(R"("labels":["neg","neu","pos"])"), std::string::npos);
}

TEST(ModelConfig, RejectsBadTaskSettings) {
  EXPECT_EQ(ParseModelConfig(R"({"name":"m","task":"translate"})", "/d").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseModelConfig(R"({"name":"m","activation":"relu"})", "/d").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseModelConfig(R"({"name":"m","task":"score","dim":2})", "/d").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseModelConfig(R"({"name":"m","task":"classify","dim":2,"labels":["a"]})", "/d").status().code(),
            StatusCode::kInvalidArgument);
}

TEST(ModelConfig, LoadsARepositoryAndRejectsDuplicates) {
  auto root = std::filesystem::temp_directory_path() / ("shoal_repo_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root / "a");
  std::filesystem::create_directories(root / "b");
  std::filesystem::create_directories(root / "not-a-model");
  std::ofstream(root / "a" / "shoal.json") << R"({"name":"alpha","runtime":"null"})";
  std::ofstream(root / "b" / "shoal.json") << R"({"name":"beta","runtime":"null"})";
  auto repo = LoadModelRepository(root.string());
  ASSERT_TRUE(repo.ok()) << repo.status().ToString();
  ASSERT_EQ(repo->size(), 2u);
  EXPECT_EQ((*repo)[0].name, "alpha");
  EXPECT_EQ((*repo)[1].dir, (root / "b").string());
  std::ofstream(root / "b" / "shoal.json") << R"({"name":"alpha","runtime":"null"})";
  EXPECT_EQ(LoadModelRepository(root.string()).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadModelRepository((root / "missing").string()).status().code(), StatusCode::kNotFound);
  std::filesystem::remove_all(root);
}

// Entries that cannot be examined are not models, and reading past them
// never throws: a symlink loop, a directory without search permission (a
// lost+found), a shoal.json that is a directory.
TEST(ModelConfig, ARepositorySkipsEntriesItCannotExamine) {
  auto root = std::filesystem::temp_directory_path() / ("shoal_repo_odd_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root / "a");
  std::ofstream(root / "a" / "shoal.json") << R"({"name":"alpha","runtime":"null"})";
  std::filesystem::create_directory_symlink(root / "loop", root / "loop");
  std::filesystem::create_directories(root / "locked");
  std::filesystem::create_directories(root / "dir-json" / "shoal.json");
  std::filesystem::permissions(root / "locked", std::filesystem::perms::none);
  auto repo = LoadModelRepository(root.string());
  std::filesystem::permissions(root / "locked", std::filesystem::perms::owner_all);
  ASSERT_TRUE(repo.ok()) << repo.status().ToString();
  ASSERT_EQ(repo->size(), 1u);
  EXPECT_EQ((*repo)[0].name, "alpha");
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace shoal
