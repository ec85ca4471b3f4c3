//! Chat templates: rendering Jinja templates (HF `chat_template`, GGUF `tokenizer.chat_template`)
//! with minijinja, and the built-in fallbacks per architecture (Gemma turns, ChatML, Llama 3).
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TokenizerError};

/// One chat message as templates see it (`message['role']`, `message['content']`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Gemma's turn format (as in Gemma 3's own template): a system message is folded into the
/// first user turn, `assistant` is called `model`.
pub const GEMMA_TEMPLATE: &str = r#"{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] ~ '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{- '<start_of_turn>' ~ role ~ '\n' ~ (first_user_prefix if loop.first else '') -}}
{{- message['content'] | trim -}}
{{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<start_of_turn>model\n' -}}
{%- endif -%}"#;

/// ChatML (Qwen).
pub const CHATML_TEMPLATE: &str = r#"{%- for message in messages -%}
{{- '<|im_start|>' ~ message['role'] ~ '\n' ~ message['content'] ~ '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- endif -%}"#;

/// Llama 3 header format.
pub const LLAMA3_TEMPLATE: &str = r#"{{- bos_token -}}
{%- for message in messages -%}
{{- '<|start_header_id|>' ~ message['role'] ~ '<|end_header_id|>\n\n' ~ (message['content'] | trim) ~ '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}"#;

/// The built-in template for a model architecture (GGUF `general.architecture` or HF
/// `model_type`), used when the checkpoint carries none.
pub fn builtin_template(arch: &str) -> Option<&'static str> {
    let a = arch.to_ascii_lowercase();
    if a.starts_with("gemma") {
        Some(GEMMA_TEMPLATE)
    } else if a.starts_with("qwen") {
        Some(CHATML_TEMPLATE)
    } else if a.starts_with("llama") {
        Some(LLAMA3_TEMPLATE)
    } else {
        None
    }
}

/// Instructions one template render may execute before it fails (minijinja "fuel").
pub const TEMPLATE_FUEL: u64 = 2_000_000;

/// A compiled chat template plus the special-token texts it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

fn raise_exception(msg: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// Compile `source`; errors name the template problem.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // Templates come from model files: bound the instructions one render may run (real
        // templates need a few dozen per message) so a hostile one cannot loop for ever.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_template_owned("chat", source.to_owned())
            .map_err(|e| TokenizerError::ChatTemplate(format!("cannot compile: {e:#}")))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// Render the conversation. `add_generation_prompt` appends the assistant turn opener.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| TokenizerError::ChatTemplate(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| TokenizerError::ChatTemplate(format!("cannot render: {e:#}")))
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", " Hi there "),
            ChatMessage::new("assistant", "Hello."),
            ChatMessage::new("user", "Why?"),
        ]
    }

    #[test]
    fn gemma_format() {
        let t = ChatTemplate::new(GEMMA_TEMPLATE, "<bos>", "<eos>").unwrap();
        let s = t.render(&conv(), true).unwrap();
        assert_eq!(
            s,
            "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n\
             <start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n"
        );
        let s = t.render(&conv()[1..2], false).unwrap();
        assert_eq!(s, "<bos><start_of_turn>user\nHi there<end_of_turn>\n");
    }

    #[test]
    fn gemma_rejects_non_alternating() {
        let t = ChatTemplate::new(GEMMA_TEMPLATE, "<bos>", "<eos>").unwrap();
        let msgs = vec![ChatMessage::new("user", "a"), ChatMessage::new("user", "b")];
        let e = t.render(&msgs, true).unwrap_err().to_string();
        assert!(e.contains("alternate"), "{e}");
    }

    #[test]
    fn chatml_and_llama3() {
        let t = ChatTemplate::new(CHATML_TEMPLATE, "", "<|im_end|>").unwrap();
        let s = t.render(&conv()[..2], true).unwrap();
        assert_eq!(
            s,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi there <|im_end|>\n\
             <|im_start|>assistant\n"
        );
        let t = ChatTemplate::new(LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>").unwrap();
        let s = t.render(&conv()[1..2], true).unwrap();
        assert_eq!(
            s,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn pycompat_methods_and_bad_template() {
        let t = ChatTemplate::new(
            "{{ messages[0]['content'].strip().upper() }}{% if messages[0]['content'].startswith(' a') %}!{% endif %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", " ab ")], false)
                .unwrap(),
            "AB!"
        );
        let e = ChatTemplate::new("{% for %}", "", "")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot compile"), "{e}");
        assert!(builtin_template("gemma3").is_some());
        assert!(builtin_template("qwen3").is_some());
        assert!(builtin_template("llama").is_some());
        assert!(builtin_template("mamba").is_none());
    }
}
