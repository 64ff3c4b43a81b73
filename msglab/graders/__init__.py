"""One grader per lab, named for the lab's topic (labs/01_request_reply_vs_events -> request_reply_vs_events).

Each module holds its workload, the roles its child processes play, and its checks, so one file
tells the whole story of what a lab's verdict means.
"""
