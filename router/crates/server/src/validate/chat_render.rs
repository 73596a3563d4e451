//! [`render_chat`]: a conversation as prompt text, with the template that applies to the
//! variant it is for: the variant's own (its directory had one), else the served model's
//! (`--chat-template` or the model's), and errors that name the request field at fault.

use super::ModelContext;
use crate::api::error::ApiError;
use crate::text::chat_template::{ChatMessage, RenderOptions};
use crate::text::TextError;

/// `messages` as prompt text, rendered with variant `adapter_id`'s own chat template when its
/// directory had one, else the served model's (`--chat-template` or the model's). Without a
/// template the error ends with `instead` (what to send instead).
pub fn render_chat(
    ctx: &ModelContext<'_>,
    adapter_id: u32,
    messages: &[ChatMessage],
    options: &RenderOptions<'_>,
    instead: &str,
) -> Result<String, ApiError> {
    let own = (adapter_id != 0)
        .then(|| ctx.model.adapters.chat_template_of(adapter_id))
        .flatten();
    let template = own.as_deref().or(ctx.chat_template).ok_or_else(|| {
        ApiError::invalid(
            "messages",
            format!(
                "the model `{}` has no chat template; {instead}",
                ctx.model.display_name(adapter_id)
            ),
        )
    })?;
    template.render(messages, options).map_err(|e| match e {
        TextError::Template(m) if m.starts_with("chat_template_kwargs.") => {
            ApiError::invalid("chat_template_kwargs", m)
        }
        TextError::Template(m) => ApiError::invalid("messages", m),
        other => ApiError::Internal(other.to_string()),
    })
}
