#include "wire/work_message.h"

#include <set>

#include <gtest/gtest.h>

namespace shoal::wire {
namespace {

TEST(WorkBody, RoundTripsTexts) {
  WorkBody b;
  b.model = "minilm-l6";
  b.texts = {"hello", "", "caf\xc3\xa9"};
  b.truncate = true;
  auto d = DecodeWorkBody(EncodeWorkBody(b));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->model, "minilm-l6");
  EXPECT_EQ(d->task, "embed");
  EXPECT_EQ(d->texts, b.texts);
  EXPECT_TRUE(d->token_ids.empty());
  EXPECT_TRUE(d->truncate);
  EXPECT_EQ(d->first_input, 0);
  b.first_input = 64;  // a later chunk of a split request
  d = DecodeWorkBody(EncodeWorkBody(b));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->first_input, 64);
  EXPECT_TRUE(d->truncate);
}

TEST(WorkBody, RoundTripsTokenIds) {
  WorkBody b;
  b.model = "m";
  b.token_ids = {{101, 7592, 102}, {101, 102}};
  auto d = DecodeWorkBody(EncodeWorkBody(b));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->token_ids, b.token_ids);
  EXPECT_FALSE(d->truncate);
}

TEST(WorkBody, RoundTripsTextPairs) {
  WorkBody b;
  b.task = "score";
  b.model = "reranker";
  b.texts = {"what is shoal", "what is shoal"};
  b.texts_pair = {"a serving cluster", ""};
  auto d = DecodeWorkBody(EncodeWorkBody(b));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->task, "score");
  EXPECT_EQ(d->texts, b.texts);
  EXPECT_EQ(d->texts_pair, b.texts_pair);
  EXPECT_EQ(d->size(), 2u);
}

TEST(WorkBody, RejectsMixedOrMalformedPairs) {
  // {"model":"m","inputs":[...]} with the given inputs, packed by hand.
  auto body = [](std::string inputs) { return std::string("\x82\xa5model\xa1m\xa6inputs") + inputs; };
  const std::string a = "\xa1" "a", b = "\xa1" "b", c = "\xa1" "c";
  // A text then a pair; a pair then a text.
  EXPECT_EQ(DecodeWorkBody(body("\x92" + a + "\x92" + b + c)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeWorkBody(body("\x92\x92" + b + c + a)).status().code(), StatusCode::kInvalidArgument);
  // A three-string "pair", and a string paired with a number.
  EXPECT_EQ(DecodeWorkBody(body("\x91\x93" + a + b + c)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeWorkBody(body("\x91\x92" + a + "\x01")).status().code(), StatusCode::kInvalidArgument);
  // Well-formed: one pair.
  auto ok = DecodeWorkBody(body("\x91\x92" + a + b));
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->texts, std::vector<std::string>{"a"});
  EXPECT_EQ(ok->texts_pair, std::vector<std::string>{"b"});
}

TEST(WorkBody, RoundTripsBinaryItems) {
  WorkBody b;
  b.task = "ocr";
  b.model = "ocr-eng";
  b.items = {std::string("\x89PNG\r\n\x1a\n\0\0", 10), std::string()};
  auto d = DecodeWorkBody(EncodeWorkBody(b));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->task, "ocr");
  EXPECT_EQ(d->items, b.items);
  EXPECT_TRUE(d->texts.empty());
  EXPECT_EQ(d->size(), 2u);
}

TEST(WorkBody, PiecesAreTheSameBytesAndMoveLargeItems) {
  WorkBody b;
  b.task = "ocr";
  b.model = "ocr-eng";
  b.items = {std::string(100, 'a'), std::string(70000, 'b'), "", std::string(65536, 'c'), std::string(3, 'd')};
  const std::string whole = EncodeWorkBody(b);
  const char* big_b = b.items[1].data();
  const char* big_c = b.items[3].data();
  EncodedMessage m = EncodeWorkBodyPieces(WorkBody(b), 65536);  // a copy: b stays for comparison
  EncodedMessage moved = EncodeWorkBodyPieces(std::move(b), 65536);
  // header+a, b, bin header, c, d+params
  ASSERT_EQ(moved.pieces.size(), 5u);
  // The large items are the pieces themselves, not copies.
  EXPECT_EQ(moved.pieces[1].data(), big_b);
  EXPECT_EQ(moved.pieces[3].data(), big_c);
  EXPECT_EQ(moved.size(), whole.size());
  EXPECT_EQ(std::move(moved).Join(), whole);
  EXPECT_EQ(std::move(m).Join(), whole);

  // Nothing over the limit: one piece, the same bytes.
  WorkBody small;
  small.model = "m";
  small.texts = {"x", "y"};
  EncodedMessage one = EncodeWorkBodyPieces(WorkBody(small), 1);
  ASSERT_EQ(one.pieces.size(), 1u);
  EXPECT_EQ(one.pieces[0], EncodeWorkBody(small));
  auto d = DecodeWorkBody(std::move(one).Join());
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->texts, small.texts);
}

TEST(WorkBody, RejectsItemsMixedWithText) {
  auto body = [](std::string inputs) { return std::string("\x82\xa5model\xa1m\xa6inputs") + inputs; };
  const std::string bin = std::string("\xc4\x01", 2) + "x", text = "\xa1" "a";
  EXPECT_EQ(DecodeWorkBody(body("\x92" + bin + text)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeWorkBody(body("\x92" + text + bin)).status().code(), StatusCode::kInvalidArgument);
  auto ok = DecodeWorkBody(body("\x92" + bin + bin));
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->items, (std::vector<std::string>{"x", "x"}));
}

TEST(WorkReply, RoundTripsItemsAndPartials) {
  WorkReply r;
  r.request_id = "r1";
  r.items = {"\x81\xa4text\xa2hi", std::string("\0", 1)};
  r.partial = true;
  r.seq = 3;
  r.item = 1;
  auto d = DecodeWorkReply(EncodeWorkReply(r));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->items, r.items);
  EXPECT_TRUE(d->partial);
  EXPECT_EQ(d->seq, 3);
  EXPECT_EQ(d->item, 1);
  r.partial = false;
  d = DecodeWorkReply(EncodeWorkReply(r));
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d->partial);
}

TEST(FloatRow, DecodesBinAndArrays) {
  const float f[2] = {0.5f, -2.0f};
  std::string bin = std::string("\xc4\x08", 2) + std::string(reinterpret_cast<const char*>(f), 8);
  auto a = DecodeFloatRow(bin);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(*a, (std::vector<float>{0.5f, -2.0f}));
  // [0.5 (float64), 3, -1]
  std::string arr = std::string("\x93\xcb\x3f\xe0\0\0\0\0\0\0\x03\xff", 12);
  auto b = DecodeFloatRow(arr);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(*b, (std::vector<float>{0.5f, 3.0f, -1.0f}));
  EXPECT_FALSE(DecodeFloatRow("\x91\xa1x").ok());            // a string in the row
  EXPECT_FALSE(DecodeFloatRow(std::string("\xc4\x03xyz", 5)).ok());  // 3 bytes
  EXPECT_FALSE(DecodeFloatRow("\xa1x").ok());                // not a row at all
  auto empty = DecodeFloatRow(std::string("\xc4\x00", 2));
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_TRUE(empty->empty());
}

// Headers that claim more elements than the message has bytes, or nesting
// far beyond what Shoal writes, are refused before msgpack-c reserves room
// for what they claim (a 5-byte map32 header claims 4 billion pairs:
// 192 GiB). Each decoder says the message is malformed.
TEST(WireDecoders, RefuseHeadersClaimingMoreThanTheMessageHolds) {
  const std::string map32 = std::string("\xdf\xff\xff\xff\xff", 5);
  const std::string array32 = std::string("\xdd\x00\x40\x00\x00", 5) + std::string(100, '\x01');
  std::string deep;
  for (int i = 0; i < 1000; ++i) deep += '\x91';
  deep += '\x01';
  for (const std::string& bad : {map32, array32, deep}) {
    for (const Status& st : {DecodeWorkBody(bad).status(), DecodeWorkReply(bad).status(), DecodeFloatRow(bad).status()}) {
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
      EXPECT_NE(st.message().find("overflow"), std::string::npos) << st.ToString();
    }
  }
}

TEST(WorkBody, RejectsGarbage) {
  auto d = DecodeWorkBody(std::string("\xc1\xff\x00garbage", 10));
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeWorkBody("").status().code(), StatusCode::kInvalidArgument);
  // A valid MessagePack value that is not a map.
  EXPECT_EQ(DecodeWorkBody("\x93\x01\x02\x03").status().code(), StatusCode::kInvalidArgument);
}

TEST(WorkBody, RefusesMoreInputsThanAMessageMayCarry) {
  WorkBody b;
  b.model = "m";
  b.texts.assign(kMaxInputsPerMessage, "");
  auto d = DecodeWorkBody(EncodeWorkBody(b));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->texts.size(), kMaxInputsPerMessage);
  b.texts.push_back("");
  d = DecodeWorkBody(EncodeWorkBody(b));
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(d.status().reason(), "too_many_inputs");
  b.texts.clear();
  b.token_ids.assign(kMaxInputsPerMessage + 1, {1});
  EXPECT_EQ(DecodeWorkBody(EncodeWorkBody(b)).status().reason(), "too_many_inputs");
  // {model: "m", inputs: [4,096 x ""], inputs: [1 x ""]}: a repeated key
  // appends, and the bound counts both.
  std::string twice = "\x83\xa5model\xa1m\xa6inputs\xdc";
  twice += '\x10';  // array16 of 0x1000
  twice += '\0';
  twice += std::string(kMaxInputsPerMessage, '\xa0') + "\xa6inputs\x91\xa0";
  d = DecodeWorkBody(twice);
  EXPECT_EQ(d.status().reason(), "too_many_inputs") << d.status().ToString();
  twice.resize(twice.size() - 2);
  twice += '\x90';  // the second list empty: 4,096 in all
  d = DecodeWorkBody(twice);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->texts.size(), kMaxInputsPerMessage);
}

TEST(WorkBody, RejectsMissingModel) {
  WorkBody b;
  b.texts = {"x"};
  EXPECT_EQ(DecodeWorkBody(EncodeWorkBody(b)).status().code(), StatusCode::kInvalidArgument);
}

TEST(WorkReply, RoundTripsEmbeddingsAsBinary) {
  WorkReply r;
  r.request_id = "abc";
  r.chunk_index = 3;
  r.rows = 2;
  r.dim = 3;
  r.embeddings = {0.5f, -1.0f, 3.25f, 1e-7f, 0.0f, -0.0f};
  r.token_counts = {4, 7};
  r.worker_id = "w1";
  std::string bytes = EncodeWorkReply(r);
  // 6 floats travel as 24 raw bytes, not as 6 MessagePack floats.
  EXPECT_NE(bytes.find(std::string(reinterpret_cast<const char*>(r.embeddings.data()), 24)), std::string::npos);
  auto d = DecodeWorkReply(bytes);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_TRUE(d->status.ok());
  EXPECT_EQ(d->request_id, "abc");
  EXPECT_EQ(d->chunk_index, 3);
  EXPECT_EQ(d->embeddings, r.embeddings);
  EXPECT_EQ(d->token_counts, r.token_counts);
  EXPECT_EQ(d->worker_id, "w1");
}

TEST(WorkReply, CarriesErrors) {
  WorkReply r;
  r.request_id = "abc";
  r.status = Unprocessable("input 0 has 300 tokens, limit 256", "input_too_long");
  auto d = DecodeWorkReply(EncodeWorkReply(r));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->status.code(), StatusCode::kUnprocessable);
  EXPECT_EQ(d->status.reason(), "input_too_long");
  EXPECT_EQ(d->status.message(), "input 0 has 300 tokens, limit 256");
}

// A reply that names its request but is unusable otherwise decodes as that
// chunk's failure (502 bad_worker_reply), so its caller hears at once; one
// without an id cannot be placed and is an error.
TEST(WorkReply, AnUnusableReplyWithAnIdIsItsChunksFailure) {
  WorkReply r;
  r.request_id = "x";
  r.chunk_index = 2;
  r.worker_id = "w9";
  r.rows = 2;
  r.dim = 2;
  r.embeddings = {1, 2, 3};
  auto d = DecodeWorkReply(EncodeWorkReply(r));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->request_id, "x");
  EXPECT_EQ(d->chunk_index, 2);
  EXPECT_FALSE(d->partial);
  EXPECT_EQ(d->status.code(), StatusCode::kBadGateway);
  EXPECT_EQ(d->status.reason(), "bad_worker_reply");
  EXPECT_NE(d->status.message().find("w9"), std::string::npos) << d->status.message();
  EXPECT_NE(d->status.message().find("rows x dim"), std::string::npos) << d->status.message();

  // {"partial": true, "error": "not a map", "id": "y"}: the id comes last.
  const std::string bad = "\x83\xa7partial\xc3\xa5" "error\xa9not a map\xa2id\xa1y";
  d = DecodeWorkReply(bad);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->request_id, "y");
  EXPECT_FALSE(d->partial);
  EXPECT_EQ(d->status.reason(), "bad_worker_reply");
  EXPECT_EQ(d->chunk_index, -1);  // it names none: not taken as chunk 0's

  // {"id": "z"}: well-formed but for no chunk; taken as chunk 0's answer,
  // it would put its rows in chunk 0's place.
  d = DecodeWorkReply(std::string("\x81\xa2id\xa1z", 6));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->request_id, "z");
  EXPECT_EQ(d->chunk_index, -1);
  EXPECT_EQ(d->status.reason(), "bad_worker_reply");
  EXPECT_NE(d->status.message().find("no chunk"), std::string::npos) << d->status.message();

  r.request_id.clear();
  EXPECT_EQ(DecodeWorkReply(EncodeWorkReply(r)).status().code(), StatusCode::kInvalidArgument);

  // Counts and indices out of int range are not wrapped: chunk 2^32 read as
  // chunk 0 would be taken as another chunk's answer.
  // {"id": "z", "chunk": 2^32}
  d = DecodeWorkReply(std::string("\x82\xa2id\xa1z\xa5" "chunk\xcf\x00\x00\x00\x01\x00\x00\x00\x00", 21));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->status.reason(), "bad_worker_reply");
  EXPECT_EQ(d->chunk_index, -1);
  // {"id": "z", "rows": -1, "dim": -4}
  d = DecodeWorkReply(std::string("\x83\xa2id\xa1z\xa4rows\xff\xa3" "dim\xfc", 17));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->status.reason(), "bad_worker_reply");
  EXPECT_NE(d->status.message().find("out of range"), std::string::npos) << d->status.message();
}

TEST(SubjectToken, IsReversibleAndSafe) {
  for (std::string name : {"minilm-l6", "org/model.v2", "a b*c>d", "x~y", "\xfcmlaut", "UPPER_lower-09"}) {
    std::string token = ModelToToken(name);
    EXPECT_EQ(token.find_first_of(". *>\t"), std::string::npos) << token;
    auto back = TokenToModel(token);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, name);
  }
  EXPECT_EQ(ModelToToken("minilm-l6"), "minilm-l6");
  EXPECT_EQ(WorkSubject("a.b"), "shoal.work.a~2Eb");
  EXPECT_EQ(ConsumerName("a.b"), "shoal_a~2Eb");
  EXPECT_FALSE(TokenToModel("bad~Z").ok());
  EXPECT_FALSE(TokenToModel("bad~4").ok());
}

TEST(SubjectToken, KvKeysUseOnlyKeyCharacters) {
  std::set<std::string> keys;
  for (std::string name : {"bge-small-en-v1.5", "org/model.v2", "a b*c>d", "x~y", "\xfcmlaut", "x=y"}) {
    std::string key = ModelKvKey(name);
    EXPECT_EQ(key.find_first_not_of("-_=abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"),
              std::string::npos) << key;
    EXPECT_TRUE(keys.insert(key).second) << "collision: " << key;
  }
  EXPECT_EQ(ModelKvKey("bge-small-en-v1.5"), "bge-small-en-v1=2E5");
}

}  // namespace
}  // namespace shoal::wire
