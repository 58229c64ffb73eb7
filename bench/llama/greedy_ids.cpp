// llama.cpp's own greedy continuation of a prompt, as token ids.
//
// `gguf-bench` compiles this against the llama.cpp build it is given
// (`--llama-cpp`) and teacher-forces the ids through tandem: comparing
// llama.cpp's text re-tokenized would count positions where the
// re-tokenization differs from what llama.cpp generated.
//
// Usage: greedy_ids MODEL.gguf N_PREDICT PROMPT
// Prints two lines of JSON: the prompt's ids (llama.cpp's BOS rule), then
// the generated ids (up to N_PREDICT, stopping at end of generation).

#include "llama.h"

#include <clocale>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static void print_ids(const std::vector<llama_token> & ids) {
    printf("[");
    for (size_t i = 0; i < ids.size(); ++i) {
        printf(i ? ",%d" : "%d", ids[i]);
    }
    printf("]\n");
}

// The batch holds `n` tokens at positions pos_0.., logits for the last.
static void fill(llama_batch_ext * batch, const llama_token * tokens, int32_t n, llama_pos pos_0) {
    llama_batch_ext_clear(batch);
    for (int32_t i = 0; i < n; ++i) {
        const int32_t idx = llama_batch_ext_add_token(batch, 0, tokens[i]);
        const llama_pos pos = pos_0 + i;
        llama_batch_ext_set_pos(batch, idx, &pos);
    }
    llama_batch_ext_set_output_logits(batch, n - 1, true);
}

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    if (argc != 4) {
        fprintf(stderr, "usage: %s MODEL.gguf N_PREDICT PROMPT\n", argv[0]);
        return 2;
    }
    const std::string prompt = argv[3];
    const int n_predict = std::atoi(argv[2]);
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (model == nullptr) {
        fprintf(stderr, "unable to load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_prompt = -llama_tokenize(vocab, prompt.c_str(), prompt.size(), nullptr, 0, true, true);
    std::vector<llama_token> ids(n_prompt);
    if (llama_tokenize(vocab, prompt.c_str(), prompt.size(), ids.data(), ids.size(), true, true) < 0) {
        fprintf(stderr, "failed to tokenize the prompt\n");
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_prompt + n_predict;
    cp.n_batch = n_prompt;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) {
        fprintf(stderr, "failed to create a context\n");
        return 1;
    }
    llama_sampler * greedy = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(greedy, llama_sampler_init_greedy());
    llama_batch_ext * batch = llama_batch_ext_init(ctx);
    fill(batch, ids.data(), n_prompt, 0);
    std::vector<llama_token> out;
    llama_pos pos = n_prompt;
    while ((int) out.size() < n_predict) {
        if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) {
            fprintf(stderr, "llama_process failed\n");
            return 1;
        }
        llama_token next = llama_sampler_sample(greedy, ctx, -1);
        if (llama_vocab_is_eog(vocab, next)) {
            break;
        }
        out.push_back(next);
        fill(batch, &next, 1, pos++);
    }
    print_ids(ids);
    print_ids(out);
    llama_batch_ext_free(batch);
    llama_sampler_free(greedy);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
