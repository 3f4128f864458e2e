//! The frame every page shares, and the small pieces of the pages' addresses: the deep link's
//! query (`domain`, repeated `descriptor`s of comma-separated `key=value` entries, `hits`).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use maud::{html, Markup, DOCTYPE};

use crate::admin::DescriptorEntry;

/// The console's sections, for the navigation bar.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Section {
    Overview,
    Explain,
    Timeline,
    Bucket,
    Login,
}

/// A whole page: the navigation (and the logout button when a token guards the listener),
/// the title and `body`.
pub(crate) fn frame(section: Section, title: &str, logout: bool, body: Markup) -> Response {
    let nav = [
        (Section::Overview, "/", "Overview"),
        (Section::Explain, "/explain", "Explain"),
        (Section::Timeline, "/timeline", "Timeline"),
    ];
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { "Tollgate · " (title) }
                link rel="stylesheet" href=(super::assets::CSS_PATH);
                link rel="icon" href=(super::assets::ICON_PATH);
                script src=(super::assets::JS_PATH) defer {}
            }
            body {
                header {
                    span.brand { "Tollgate" }
                    @if section != Section::Login {
                        nav {
                            @for (s, href, label) in nav {
                                a href=(href) class=[(s == section).then_some("current")] { (label) }
                            }
                        }
                        @if logout {
                            form.action.logout data-post=(crate::admin::session::LOGOUT_PATH) data-body="{}" data-then="/login" {
                                button type="submit" { "Log out" }
                            }
                        }
                    }
                }
                main {
                    h1 { (title) }
                    (body)
                }
            }
        }
    };
    html_response(StatusCode::OK, markup)
}

/// `markup` as a `text/html` answer with `status`.
pub(crate) fn html_response(status: StatusCode, markup: Markup) -> Response {
    let mut response = (status, markup.into_string()).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    response
}

/// A refill rate for a column headed "Refill": `5 per s`, `1 per 360 s`, `no refill`.
pub(crate) fn refill(per_second: f64) -> String {
    let text = crate::admin::explain::refill_text(per_second);
    text.strip_prefix("refill ").map_or(text.clone(), str::to_owned)
}

/// The pairs of a query string, decoded, in order.
pub(crate) fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
    form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

/// The first value of `name` in `pairs`, if given and not blank.
pub(crate) fn first<'a>(pairs: &'a [(String, String)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, v)| k == name && !v.trim().is_empty())
        .map(|(_, v)| v.trim())
}

/// The descriptors of a query: each `descriptor` value, and each line of one (the form's
/// text area sends them one a line), as `key=value` entries separated by commas.
///
/// Errors name the descriptor and the entry that is not `key=value` with a key.
pub(crate) fn descriptors(pairs: &[(String, String)]) -> Result<Vec<Vec<DescriptorEntry>>, String> {
    let mut out = Vec::new();
    for (_, given) in pairs.iter().filter(|(k, _)| k == "descriptor") {
        for line in given.lines().map(str::trim).filter(|l| !l.is_empty()) {
            out.push(descriptor(line)?);
        }
    }
    Ok(out)
}

/// One descriptor, `tenant=a,path=/x`.
pub(crate) fn descriptor(text: &str) -> Result<Vec<DescriptorEntry>, String> {
    text.split(',')
        .map(|entry| match entry.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() => Ok(DescriptorEntry {
                key: key.trim().to_owned(),
                value: value.to_owned(),
            }),
            _ => Err(format!(
                "descriptor `{text}`: entry `{entry}` is not key=value (entries are separated by commas)"
            )),
        })
        .collect()
}

/// A descriptor as the deep link writes it.
pub(crate) fn descriptor_text(entries: &[DescriptorEntry]) -> String {
    entries
        .iter()
        .map(|e| format!("{}={}", e.key, e.value))
        .collect::<Vec<_>>()
        .join(",")
}

/// `path?name=value&...`, each pair encoded.
pub(crate) fn link(path: &str, pairs: &[(&str, &str)]) -> String {
    let mut query = form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        query.append_pair(k, v);
    }
    format!("{path}?{}", query.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deep_link_descriptors() {
        let pairs = query_pairs(Some(
            "domain=edge&descriptor=api_key%3Ddemo&descriptor=tenant=a,path=/x%3Dy",
        ));
        let got = descriptors(&pairs).unwrap();
        assert_eq!(descriptor_text(&got[0]), "api_key=demo");
        assert_eq!(got[1].len(), 2);
        assert_eq!((got[1][1].key.as_str(), got[1][1].value.as_str()), ("path", "/x=y"));
        let lines = query_pairs(Some("descriptor=a%3D1%0D%0Ab%3D2"));
        assert_eq!(descriptors(&lines).unwrap().len(), 2, "one a line");
        let err = descriptors(&query_pairs(Some("descriptor=a=1,oops"))).unwrap_err();
        assert!(err.contains("`oops`"), "{err}");
        assert!(descriptor("=x").is_err(), "a key is needed");
    }

    #[test]
    fn links_encode_their_values() {
        assert_eq!(
            link("/explain", &[("domain", "a b"), ("descriptor", "k=v&x")]),
            "/explain?domain=a+b&descriptor=k%3Dv%26x"
        );
    }
}
