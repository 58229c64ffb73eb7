//! The "try it" block `tandem up` prints once the cluster is ready: a
//! `tandem chat` line, a curl line and a Python `openai` snippet, with the
//! cluster's real addresses and model name, so a first run ends with
//! something to type.

use std::fmt::Write as _;

/// What the block needs to know about the running cluster.
pub struct Cluster<'a> {
    /// How this binary was invoked (`target/release/tandem`, `tandem`).
    pub exe: &'a str,
    /// The router's gRPC address.
    pub grpc: &'a str,
    /// The router's OpenAI HTTP address, when it serves one.
    pub http: Option<&'a str>,
    /// The checkpoint directory, `None` for the built-in model.
    pub model_dir: Option<&'a str>,
    /// The name HTTP clients pass as `model`.
    pub model_name: &'a str,
    /// The certificate directory of a `--tls` cluster.
    pub tls_dir: Option<&'a str>,
    /// Whether the router wants an API key.
    pub api_key: bool,
}

/// The block, ready to print.
pub fn render(c: &Cluster<'_>) -> String {
    let mut out = String::from("\nTry it:\n");
    let mut chat = format!("  {} chat --router {}", c.exe, c.grpc);
    if let Some(dir) = c.model_dir {
        chat.push_str(&format!(" --model {}", shell_quote(dir)));
    }
    if let Some(tls) = c.tls_dir {
        chat.push_str(&format!(
            " --tls-ca {tls}/ca.pem --tls-cert {tls}/client.pem --tls-key {tls}/client.key"
        ));
    }
    if c.api_key {
        chat.push_str(" --api-key $TANDEM_API_KEY");
    }
    let _ = writeln!(out, "{chat}");
    let Some(http) = c.http else {
        return out;
    };
    let body = serde_json::json!({
        "model": c.model_name,
        "messages": [{"role": "user", "content": "Hello!"}],
        "max_tokens": 32,
    });
    let auth = match c.api_key {
        true => " -H \"Authorization: Bearer $TANDEM_API_KEY\"",
        false => "",
    };
    let _ = writeln!(
        out,
        "  curl http://{http}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d {}",
        shell_quote(&body.to_string())
    );
    let key = match c.api_key {
        true => "os.environ[\"TANDEM_API_KEY\"]",
        false => "\"none\"",
    };
    let _ = writeln!(
        out,
        "  python3 -c 'import os; from openai import OpenAI; \
         c = OpenAI(base_url=\"http://{http}/v1\", api_key={key}); \
         print(c.chat.completions.create(model=\"{}\", \
         messages=[{{\"role\": \"user\", \"content\": \"Hello!\"}}], max_tokens=32)\
         .choices[0].message.content)'",
        c.model_name.replace('\'', "").replace('"', "\\\"")
    );
    out
}

/// `s` single-quoted for a POSIX shell.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_real_addresses_and_model() {
        let block = render(&Cluster {
            exe: "tandem",
            grpc: "127.0.0.1:50051",
            http: Some("127.0.0.1:8000"),
            model_dir: None,
            model_name: "shakespeare-target",
            tls_dir: None,
            api_key: false,
        });
        assert!(
            block.contains("tandem chat --router 127.0.0.1:50051\n"),
            "{block}"
        );
        assert!(
            block.contains("curl http://127.0.0.1:8000/v1/chat/completions"),
            "{block}"
        );
        assert!(
            block.contains(r#"\"model\":\"shakespeare-target\""#)
                || block.contains(r#""model":"shakespeare-target""#),
            "{block}"
        );
        assert!(
            block.contains("base_url=\"http://127.0.0.1:8000/v1\""),
            "{block}"
        );
    }

    #[test]
    fn without_http_only_the_chat_line() {
        let block = render(&Cluster {
            exe: "/x/tandem",
            grpc: "127.0.0.1:7",
            http: None,
            model_dir: Some("/models/it's"),
            model_name: "m",
            tls_dir: Some("/tmp/certs"),
            api_key: true,
        });
        assert!(block.contains("--model '/models/it'\\''s'"), "{block}");
        assert!(block.contains("--tls-ca /tmp/certs/ca.pem"), "{block}");
        assert!(block.contains("--api-key $TANDEM_API_KEY"), "{block}");
        assert!(!block.contains("curl"), "{block}");
    }
}
