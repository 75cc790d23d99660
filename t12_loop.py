import corral
for rules in (["127.0.0.1:18765"], ["localhost:18765"], ["pypi.org"]):
    try:
        with corral.Sandbox.create(egress=rules) as sb:
            r = sb.run("wget -q -O - -T 5 http://127.0.0.1:18765/secret.txt 2>&1; echo rc=$?; wget -q -O - -T 5 http://localhost:18765/secret.txt 2>&1; echo rc=$?", timeout=30)
            print(rules, repr(r.output))
    except Exception as e:
        print(rules, type(e).__name__, e)
