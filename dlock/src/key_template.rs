//! Lock key templates such as `"account:{account_id}"`, and the encoding of the values put
//! into them.
//!
//! The attribute macro and the axum layer build keys from a template and values that come
//! from arguments, struct fields or path parameters. Both use this module, so one template
//! rendered from the same values gives the same key. The values are not always the same: the
//! macro formats an argument's parsed value (`42` for a `u64` however the request spelled it),
//! while the layer's template (`dlock_axum::LockLayer::new`) renders the text of the path
//! (`042` for `/accounts/042`). They agree for `String` parameters; for typed ones the layer
//! makes its key from the handler's extractor (`dlock_axum::LockLayer::with_extractor`).
//!
//! # Template syntax
//!
//! | in the template | means |
//! |---|---|
//! | `{name}` or `<name>` | the value of `name`, [encoded](encode_component) |
//! | `{{` `}}` `<<` `>>` | a literal `{` `}` `<` `>` |
//! | anything else | itself |
//!
//! A name is one or more ASCII letters, digits, `_` or `.` (`{cmd.account_id}` lets the macro
//! reach into a parameter); spaces around it are ignored. A lone `}` or `>`, an unclosed
//! placeholder or an empty name is an error, so a typo never silently becomes part of every
//! key. Two placeholders must have a `:` (or `{` `}` `<` `>`) between them: `"{a}-{b}"` is an
//! error, because `("x-y", "z")` and `("x", "y-z")` would render to the same key.
//!
//! # Why values are encoded
//!
//! Without encoding, `"{a}:{b}"` renders `a = "x:y", b = "z"` and `a = "x", b = "y:z"` to the
//! same key `x:y:z`, and two requests that should not exclude each other would. Encoding `:`,
//! `%`, the brace and angle characters and control characters in values (as `%XX`, uppercase,
//! of their UTF-8 bytes) makes the rendering injective: distinct values always give distinct
//! keys.
//!
//! ```
//! use dlock::key_template::KeyTemplate;
//!
//! let template = KeyTemplate::parse("account:{account_id}").unwrap();
//! let key = template
//!     .render(|name| (name == "account_id").then_some("42:7"))
//!     .unwrap();
//! assert_eq!(key, "account:42%3A7");
//! ```

use std::borrow::Cow;
use std::fmt::{self, Display, Write as _};

/// Percent-encodes the characters of a template value that could make two distinct values
/// render to the same key: `:` `%` `{` `}` `<` `>` and control characters (`char::is_control`:
/// U+0000–U+001F, U+007F–U+009F), each as `%XX` (uppercase hex) of its UTF-8 bytes.
///
/// Everything else, including non-ASCII letters, is kept as is. Returns the value borrowed
/// when nothing needs encoding, so the common case does not allocate.
///
/// ```
/// use dlock::key_template::encode_component;
///
/// assert_eq!(encode_component("42"), "42");
/// assert_eq!(encode_component("a:b%c"), "a%3Ab%25c");
/// assert_eq!(encode_component("{x}<y>"), "%7Bx%7D%3Cy%3E");
/// assert_eq!(encode_component("line\nbreak\u{85}"), "line%0Abreak%C2%85");
/// assert_eq!(encode_component("ключ/ü"), "ключ/ü");
/// ```
pub fn encode_component(value: &str) -> Cow<'_, str> {
    if !value.contains(needs_encoding) {
        return Cow::Borrowed(value);
    }
    let mut out = String::with_capacity(value.len() + 8);
    push_encoded(&mut out, value);
    Cow::Owned(out)
}

/// Characters whose presence between two placeholders keeps keys injective: values never
/// contain them unencoded.
fn is_separator(c: char) -> bool {
    matches!(c, ':' | '{' | '}' | '<' | '>') || c.is_control()
}

/// Whether a character of a value is percent-encoded in a lock key.
fn needs_encoding(c: char) -> bool {
    matches!(c, ':' | '%' | '{' | '}' | '<' | '>') || c.is_control()
}

/// Appends `value` to `out`, encoded as [`encode_component`] describes.
fn push_encoded(out: &mut String, value: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut rest = value;
    while let Some(at) = rest.find(needs_encoding) {
        out.push_str(&rest[..at]);
        let Some(c) = rest[at..].chars().next() else {
            break;
        };
        let mut utf8 = [0u8; 4];
        for byte in c.encode_utf8(&mut utf8).bytes() {
            out.push('%');
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0x0F)]));
        }
        rest = &rest[at + c.len_utf8()..];
    }
    out.push_str(rest);
}

/// Streams a value's [`Display`] output into a key, encoded, without an intermediate string.
struct Encoder<'a>(&'a mut String);

impl fmt::Write for Encoder<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        push_encoded(self.0, s);
        Ok(())
    }
}

/// Builds a lock key from literal text and encoded values, the way
/// `#[distributed_lock("...")]` does.
///
/// [`literal`](KeyBuilder::literal) appends text as it is; [`value`](KeyBuilder::value)
/// appends a value's [`Display`] output encoded by [`encode_component`].
///
/// ```
/// use dlock::key_template::KeyBuilder;
///
/// let mut key = KeyBuilder::new();
/// key.literal("transfer:").value(&"1:2").literal(":").value(&3);
/// assert_eq!(key.finish(), "transfer:1%3A2:3");
/// ```
#[derive(Debug, Default, Clone)]
pub struct KeyBuilder {
    key: String,
}

impl KeyBuilder {
    /// An empty key.
    pub fn new() -> Self {
        KeyBuilder::default()
    }

    /// An empty key with room for `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        KeyBuilder {
            key: String::with_capacity(capacity),
        }
    }

    /// Appends `text` as it is.
    pub fn literal(&mut self, text: &str) -> &mut Self {
        self.key.push_str(text);
        self
    }

    /// Appends `value`'s [`Display`] output, percent-encoded (see [`encode_component`]).
    pub fn value(&mut self, value: &(impl Display + ?Sized)) -> &mut Self {
        // Writing to a `String` cannot fail; a `Display` impl that reports an error anyway
        // keeps what it wrote before the error.
        let _ = write!(Encoder(&mut self.key), "{value}");
        self
    }

    /// The key.
    pub fn finish(self) -> String {
        self.key
    }
}

/// A parsed lock key template such as `"account:{account_id}"`.
///
/// See the [module documentation](self) for the syntax. Parse once, render per call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyTemplate {
    source: String,
    segments: Vec<Segment>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Placeholder(String),
}

/// What is wrong with a key template, or why it could not be rendered.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TemplateError {
    /// A `{` or `<` at byte `position` has no matching `}` or `>`.
    Unclosed {
        /// Byte offset of the opening character.
        position: usize,
    },
    /// A `}` or `>` at byte `position` closes nothing (write `}}` or `>>` for the character).
    Unopened {
        /// Byte offset of the character.
        position: usize,
    },
    /// The placeholder at byte `position` has an empty name or characters other than ASCII
    /// letters, digits, `_` and `.`.
    BadName {
        /// Byte offset of the opening character.
        position: usize,
        /// The name as written.
        name: String,
    },
    /// Two placeholders are not separated by a `:` (or another character that values never
    /// contain unencoded: `{` `}` `<` `>` or a control character), so distinct values could
    /// render to the same key (`"ab"` + `"c"` and `"a"` + `"bc"`).
    NoSeparator {
        /// Byte offset of the second placeholder.
        position: usize,
    },
    /// [`KeyTemplate::render`] found no value for this placeholder.
    Missing {
        /// The placeholder's name.
        name: String,
    },
}

impl fmt::Display for TemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TemplateError::Unclosed { position } => write!(
                f,
                "the placeholder opened at byte {position} is not closed \
                 (write `{{{{` or `<<` for a literal `{{` or `<`)"
            ),
            TemplateError::Unopened { position } => write!(
                f,
                "the `}}` or `>` at byte {position} closes nothing \
                 (write `}}}}` or `>>` for a literal `}}` or `>`)"
            ),
            TemplateError::BadName { position, name } => write!(
                f,
                "the placeholder at byte {position} has the name `{}`; a name is one or more \
                 ASCII letters, digits, `_` or `.`",
                name.escape_debug()
            ),
            TemplateError::NoSeparator { position } => write!(
                f,
                "the placeholder at byte {position} needs a `:` between it and the one before: \
                 without one, distinct values could give the same key"
            ),
            TemplateError::Missing { name } => {
                write!(f, "no value for the placeholder `{}`", name.escape_debug())
            }
        }
    }
}

impl std::error::Error for TemplateError {}

impl From<TemplateError> for crate::LockError {
    fn from(err: TemplateError) -> Self {
        crate::LockError::config(format!("lock key template: {err}"))
    }
}

impl KeyTemplate {
    /// Parses `template`.
    ///
    /// ```
    /// use dlock::key_template::{KeyTemplate, TemplateError};
    ///
    /// let t = KeyTemplate::parse("{{literal}}:<id>:{tenant.id}").unwrap();
    /// assert_eq!(t.placeholders().collect::<Vec<_>>(), ["id", "tenant.id"]);
    /// assert_eq!(
    ///     KeyTemplate::parse("account:{id"),
    ///     Err(TemplateError::Unclosed { position: 8 })
    /// );
    /// ```
    pub fn parse(template: &str) -> Result<KeyTemplate, TemplateError> {
        let mut segments = Vec::new();
        let mut literal = String::new();
        let mut chars = template.char_indices().peekable();
        while let Some((position, c)) = chars.next() {
            match c {
                '{' | '<' | '}' | '>' if chars.peek().map(|&(_, next)| next) == Some(c) => {
                    chars.next();
                    literal.push(c);
                }
                '{' | '<' => {
                    let close = if c == '{' { '}' } else { '>' };
                    let start = position + 1;
                    let Some(len) = template[start..].find(close) else {
                        return Err(TemplateError::Unclosed { position });
                    };
                    let name = template[start..start + len].trim();
                    if name.is_empty()
                        || !name
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
                    {
                        return Err(TemplateError::BadName {
                            position,
                            name: name.to_owned(),
                        });
                    }
                    // Skip the name and the closing character.
                    while chars.next_if(|&(i, _)| i <= start + len).is_some() {}
                    if !literal.is_empty() {
                        segments.push(Segment::Literal(std::mem::take(&mut literal)));
                    }
                    let separated = match segments.as_slice() {
                        [.., Segment::Placeholder(_)] => false,
                        [.., Segment::Placeholder(_), Segment::Literal(between)] => {
                            between.chars().any(is_separator)
                        }
                        _ => true,
                    };
                    if !separated {
                        return Err(TemplateError::NoSeparator { position });
                    }
                    segments.push(Segment::Placeholder(name.to_owned()));
                }
                '}' | '>' => return Err(TemplateError::Unopened { position }),
                _ => literal.push(c),
            }
        }
        if !literal.is_empty() {
            segments.push(Segment::Literal(literal));
        }
        Ok(KeyTemplate {
            source: template.to_owned(),
            segments,
        })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// The placeholder names, in order of appearance (repeated names appear repeatedly).
    pub fn placeholders(&self) -> impl Iterator<Item = &str> + '_ {
        self.segments.iter().filter_map(|segment| match segment {
            Segment::Placeholder(name) => Some(name.as_str()),
            Segment::Literal(_) => None,
        })
    }

    /// Renders the key: each placeholder becomes `value(name)`, passed through
    /// [`encode_component`]; literals are copied as written (after unescaping `{{` and the
    /// like). Fails with [`TemplateError::Missing`] when `value` returns `None`.
    ///
    /// ```
    /// use dlock::key_template::KeyTemplate;
    ///
    /// let t = KeyTemplate::parse("transfer:{from}->>{to}").unwrap();
    /// let key = t.render(|name| match name {
    ///     "from" => Some("a"),
    ///     "to" => Some("b:c"),
    ///     _ => None,
    /// });
    /// assert_eq!(key.unwrap(), "transfer:a->b%3Ac");
    /// ```
    pub fn render<F, V>(&self, mut value: F) -> Result<String, TemplateError>
    where
        F: FnMut(&str) -> Option<V>,
        V: AsRef<str>,
    {
        let mut key = String::with_capacity(self.source.len() + 16);
        for segment in &self.segments {
            match segment {
                Segment::Literal(text) => key.push_str(text),
                Segment::Placeholder(name) => {
                    let Some(v) = value(name) else {
                        return Err(TemplateError::Missing { name: name.clone() });
                    };
                    key.push_str(&encode_component(v.as_ref()));
                }
            }
        }
        Ok(key)
    }
}

impl fmt::Display for KeyTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

impl std::str::FromStr for KeyTemplate {
    type Err = TemplateError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KeyTemplate::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_structure_and_control_characters() {
        assert_eq!(
            encode_component("a:b%c{d}<e>\n\u{7f}\u{85}é鍵 /"),
            "a%3Ab%25c%7Bd%7D%3Ce%3E%0A%7F%C2%85é鍵 /"
        );
        assert_eq!(encode_component(""), "");
        let mut negative = KeyBuilder::new();
        negative.value(&-7i64);
        assert_eq!(negative.finish(), "-7");
        assert_eq!(encode_component("%3A"), "%253A");
    }

    #[test]
    fn builder_keeps_literals_and_encodes_values() {
        let mut a = KeyBuilder::with_capacity(16);
        a.literal("t:").value("1:2").literal(":").value("3");
        let mut b = KeyBuilder::new();
        b.literal("t:").value("1").literal(":").value("2:3");
        assert_eq!(a.clone().finish(), "t:1%3A2:3");
        assert_ne!(a.finish(), b.finish());
    }

    fn render(template: &str, pairs: &[(&str, &str)]) -> Result<String, TemplateError> {
        KeyTemplate::parse(template)?.render(|name| {
            pairs
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, value)| *value)
        })
    }

    #[test]
    fn encoding_keeps_plain_values_borrowed() {
        assert!(matches!(encode_component("plain-42_ü"), Cow::Borrowed(_)));
        assert!(matches!(encode_component(""), Cow::Borrowed(_)));
        assert!(matches!(encode_component("a:b"), Cow::Owned(_)));
    }

    #[test]
    fn encoding_covers_separators_and_controls() {
        assert_eq!(encode_component(":%{}<>"), "%3A%25%7B%7D%3C%3E");
        assert_eq!(encode_component("\0\t\r\n\u{7f}"), "%00%09%0D%0A%7F");
        assert_eq!(encode_component("\u{9f}"), "%C2%9F");
        assert_eq!(encode_component("ok/ok?x=1&y"), "ok/ok?x=1&y");
        // An already encoded value is encoded again, so it stays distinct from its decoding.
        assert_eq!(encode_component("%3A"), "%253A");
    }

    #[test]
    fn distinct_values_give_distinct_keys() {
        let values = [
            "x", "x:y", "y", "y:z", "z", ":", "%3A", "%", "", "{y}", "<y>",
        ];
        let mut seen = std::collections::HashSet::new();
        for a in values {
            for b in values {
                let key = render("{a}:{b}", &[("a", a), ("b", b)]).unwrap();
                assert!(seen.insert(key.clone()), "{a:?} {b:?} collided on {key:?}");
            }
        }
    }

    #[test]
    fn parses_both_spellings_and_escapes() {
        assert_eq!(
            render("account:{id}", &[("id", "42")]).unwrap(),
            "account:42"
        );
        assert_eq!(
            render("account:<id>", &[("id", "42")]).unwrap(),
            "account:42"
        );
        assert_eq!(
            render("{{{id}}}<<<id>>>", &[("id", "7")]).unwrap(),
            "{7}<7>"
        );
        assert_eq!(
            render("{a}:{ b }", &[("a", "1"), ("b", "2")]).unwrap(),
            "1:2"
        );
        assert_eq!(
            KeyTemplate::parse("{a}{b}"),
            Err(TemplateError::NoSeparator { position: 3 })
        );
        assert_eq!(
            KeyTemplate::parse("{a}-{b}"),
            Err(TemplateError::NoSeparator { position: 4 })
        );
        assert!(KeyTemplate::parse("{a}->>{b}").is_ok());
        assert_eq!(
            render("{cmd.account_id}", &[("cmd.account_id", "9")]).unwrap(),
            "9"
        );
        assert_eq!(render("static", &[]).unwrap(), "static");
        assert_eq!(render("ü:{k}:鍵", &[("k", "ключ")]).unwrap(), "ü:ключ:鍵");
    }

    #[test]
    fn rejects_malformed_templates() {
        assert_eq!(
            KeyTemplate::parse("a{b"),
            Err(TemplateError::Unclosed { position: 1 })
        );
        assert_eq!(
            KeyTemplate::parse("a<b"),
            Err(TemplateError::Unclosed { position: 1 })
        );
        assert_eq!(
            KeyTemplate::parse("a}b"),
            Err(TemplateError::Unopened { position: 1 })
        );
        assert_eq!(
            KeyTemplate::parse("x->y"),
            Err(TemplateError::Unopened { position: 2 })
        );
        assert!(matches!(
            KeyTemplate::parse("{}"),
            Err(TemplateError::BadName { position: 0, .. })
        ));
        assert!(matches!(
            KeyTemplate::parse("{a b}"),
            Err(TemplateError::BadName { .. })
        ));
        // `{a>` is an unclosed `{`, not a `{` closed by `>`.
        assert!(KeyTemplate::parse("{a>").is_err());
    }

    #[test]
    fn missing_value_is_an_error() {
        assert_eq!(
            render("account:{id}", &[]),
            Err(TemplateError::Missing { name: "id".into() })
        );
        let err = crate::LockError::from(TemplateError::Missing { name: "id".into() });
        assert_eq!(err.code(), "DistributedLock.Configuration");
    }

    #[test]
    fn lists_placeholders_and_round_trips() {
        let t: KeyTemplate = "a:{x}:<y>:{x}".parse().unwrap();
        assert_eq!(t.placeholders().collect::<Vec<_>>(), ["x", "y", "x"]);
        assert_eq!(t.to_string(), "a:{x}:<y>:{x}");
        assert_eq!(t.as_str(), "a:{x}:<y>:{x}");
    }

    #[test]
    fn errors_say_where_and_what() {
        let shown = |e: TemplateError| e.to_string();
        assert_eq!(
            shown(TemplateError::Unclosed { position: 3 }),
            "the placeholder opened at byte 3 is not closed (write `{{` or `<<` for a literal `{` or `<`)"
        );
        assert_eq!(
            shown(TemplateError::Unopened { position: 4 }),
            "the `}` or `>` at byte 4 closes nothing (write `}}` or `>>` for a literal `}` or `>`)"
        );
        assert!(
            shown(TemplateError::BadName {
                position: 5,
                name: "a\nb".into()
            })
            .starts_with("the placeholder at byte 5 has the name `a\\nb`;")
        );
        assert!(
            shown(TemplateError::NoSeparator { position: 6 })
                .starts_with("the placeholder at byte 6 needs a `:`")
        );
        assert_eq!(
            shown(TemplateError::Missing { name: "id".into() }),
            "no value for the placeholder `id`"
        );
    }
}
